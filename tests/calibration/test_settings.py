"""Calibration settings are typed and checked once (issue 34): the library's errors name the setting, the command
spells the same error as its flag, and the sequence-length bound is one constant."""

from pathlib import Path
from types import SimpleNamespace

import pytest

from oscar_zoo import texts
from oscar_zoo.calibration.calibration_passes import calibrate
from oscar_zoo.calibration.settings import AccumulateOn, CalibrationRequest, CalibrationSettings
from oscar_zoo.commands.calibrate import flag
from oscar_zoo.errors import SettingError
from oscar_zoo.format.layout import Centring
from oscar_zoo.format.schema import ClipMode, Granularity, QuantSpec, ValueTarget
from oscar_zoo.texts import MIN_SEQ_LEN, make_sequences

from ..test_calibrate_cli import SMALL, text_file  # noqa: F401 -- fixture


class _Tokenizer:
    """One token per character: enough for make_sequences."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) % 100 for c in text]}


def test_strings_become_the_enums_the_manifest_writes():
    s = CalibrationSettings(granularity="per-layer", value_target="softmax", clip="fixed", centring="mean",
                            accumulate_on="cpu")
    assert (s.granularity, s.value_target, s.clip, s.centring, s.accumulate_on) == (
        Granularity.PER_LAYER, ValueTarget.SOFTMAX, ClipMode.FIXED, Centring.MEAN, AccumulateOn.CPU)
    assert type(s.clip) is ClipMode and type(s.centring) is Centring
    # the manifest's field is the same Enum, written as its value
    quant = QuantSpec(group_size=16, sink=64, recent=256, flush=8, centring=s.centring)
    assert quant.to_dict()["centring"] == "mean" and quant.centring is Centring.MEAN
    with pytest.raises(SettingError) as err:
        CalibrationSettings(centring="median")
    assert err.value.setting == "centring" and err.value.message == "centring 'median': expected one of none, mean"


def test_a_bad_group_size_is_named_by_the_library_and_spelled_as_the_flag_by_the_command(run_cli, tiny_model_dir,
                                                                                       text_file, tmp_path,
                                                                                       monkeypatch):
    with pytest.raises(SettingError) as below:
        CalibrationSettings(group_size=-4)
    assert below.value.setting == "group_size" and below.value.message.startswith("group_size -4: expected 0")
    assert "--" not in below.value.message

    settings = CalibrationSettings(group_size=48)  # ≥ 0: only the head dim can refuse it
    assert CalibrationSettings(group_size=16, key_block=0).group_for(64) == 16
    assert CalibrationSettings().group_for(64) == 64
    with pytest.raises(SettingError, match="values are coded per row"):  # keys per channel: values per row (§6d)
        CalibrationSettings(group_size=16).group_for(64)
    with pytest.raises(SettingError) as misfit:
        settings.group_for(64)
    assert misfit.value.setting == "group_size"
    assert misfit.value.message.startswith("group_size 48: expected 0 or a divisor of the model's head_dim 64")
    # the library entry refuses it through the same check, before anything else is looked at
    with pytest.raises(SettingError) as direct:
        calibrate(SimpleNamespace(info=SimpleNamespace(head_dim=64)), None, settings)
    assert direct.value.message == misfit.value.message

    # the command prints exactly the library's error, spelled with flags
    monkeypatch.setenv("OSCAR_ZOO_CACHE", str(tmp_path / "cache"))
    for value, error in (("-4", below.value), ("48", misfit.value)):
        code, _, err = run_cli("calibrate", tiny_model_dir, "--dataset", text_file, *SMALL, "--group-size", value,
                               "--out", tmp_path / "art")
        assert code == 2, err
        assert " ".join(err.split()).startswith("error: " + error.spelled(flag).message), err
        assert f"--group-size {value}: expected" in err


def test_the_minimum_sequence_length_is_one_constant(monkeypatch, tmp_path):
    text = ["x" * 4000]
    assert len(make_sequences(_Tokenizer(), text, MIN_SEQ_LEN, 2, 1).input_ids[0]) == MIN_SEQ_LEN
    CalibrationRequest(out=tmp_path, seq_len=MIN_SEQ_LEN, tokens=MIN_SEQ_LEN)
    for refuse in (lambda n: make_sequences(_Tokenizer(), text, n, 2, 1),
                   lambda n: CalibrationRequest(out=tmp_path, seq_len=n, tokens=4 * n)):
        with pytest.raises(SettingError) as err:
            refuse(MIN_SEQ_LEN - 1)
        assert err.value.setting == "seq_len"
        assert err.value.message == f"seq_len {MIN_SEQ_LEN - 1}: expected at least {MIN_SEQ_LEN} tokens per sequence"
        assert err.value.spelled(flag).message.startswith(f"--seq-len {MIN_SEQ_LEN - 1}: ")
    # both the command's early check and make_sequences read the same constant: moving it moves both
    monkeypatch.setattr(texts, "MIN_SEQ_LEN", 2 * MIN_SEQ_LEN)
    for refuse in (lambda n: make_sequences(_Tokenizer(), text, n, 2, 1),
                   lambda n: CalibrationRequest(out=Path(tmp_path), seq_len=n, tokens=4 * n)):
        with pytest.raises(SettingError, match=f"expected at least {2 * MIN_SEQ_LEN} tokens"):
            refuse(MIN_SEQ_LEN)


def test_library_errors_name_settings_and_the_entry_point_spells_flags(run_cli, tmp_path):
    """Dataset, revision and device errors of the library name the setting (split, text_field, revision); the one
    error boundary (oscar_zoo.cli.main) spells them as the flags the user typed."""
    from oscar_zoo.errors import SettingError
    from oscar_zoo.models import check_revision_applies
    from oscar_zoo.texts import check_dataset_options

    for call, name in ((lambda: check_dataset_options(None, "validation", None), "split"),
                       (lambda: check_dataset_options(None, None, "body"), "text_field"),
                       (lambda: check_revision_applies(str(tmp_path), "v1"), "revision")):
        with pytest.raises(SettingError) as info:
            call()
        assert info.value.setting == name and info.value.message.startswith(name) and "--" not in info.value.message
    code, out, err = run_cli("calibrate", "demo", "--split", "validation", "--out", tmp_path / "a")
    assert code == 2 and "--split validation" in err

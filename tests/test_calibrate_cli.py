"""`oscar-zoo calibrate` / `inspect` end to end on a random-weight model folder, cache reuse, resume after an
interruption, and bad input: each a one-line error with the documented exit code and no partial artifact folder."""

import json
import shutil

import pytest
import torch

from oscar_zoo.artifacts import check_model_matches, load_artifacts, read_manifest
from oscar_zoo.calibration.calibration_passes import AccumulatorStore, CalibrationSettings, calibrate
from oscar_zoo.errors import IntegrityError
from oscar_zoo.format import reference as R
from oscar_zoo.format.io import load_tensors
from oscar_zoo.format.schema import Manifest
from oscar_zoo.models import load_model
from oscar_zoo.texts import corpus_dir, make_sequences

SMALL = ["--tokens", "256", "--seq-len", "64", "--heldout", "1", "--device", "cpu", "--dtype", "float32"]


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "corpus" / "play.txt"
    path.parent.mkdir()
    path.write_text((corpus_dir() / "coriolanus_gut.txt").read_text()[:20000])
    return path


@pytest.fixture
def calibrated(run_cli, tiny_model_dir, text_file, tmp_path, monkeypatch):
    monkeypatch.setenv("OSCAR_ZOO_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "art"
    code, stdout, stderr = run_cli("calibrate", tiny_model_dir, "--dataset", text_file, *SMALL, "--out", out, "--json",
                                   "--key-block", "0")  # keys per row, searched clips (the default: per channel)
    assert code == 0, stderr
    return out, json.loads(stdout)


def _check_k_clips_minimise_the_logit_error(cache, rot, grid, key_bits=None):
    """Recompute the K clip choice independently of the clip search's code: for each (layer, KV head) and grid ratio,
    quantize the held-out keys in the rotated space, rotate the error δk back (δk·Mᵀ) and take the mean squared logit
    error E[(q·δk)²] = δkᵀ C_Q δk in float64, C_Q the calibration queries' second moment from the pass-1 sums. The
    stored ratio must attain the smallest error, and the errors must tell the ratios apart (else nothing is checked).
    With `key_bits` (the manifest's): the layers with 3-bit keys are exactly the round((2.7 − 2)·L) whose unclipped
    INT2 error (ratio 1.0, summed over heads) is largest, and their keys are not clipped (ratio 1.0)."""
    (store,) = (cache / "calibration").iterdir()  # the one accumulator store of this run
    pass1, heldout = load_tensors(store / "pass1.safetensors"), load_tensors(store / "heldout.safetensors")
    C_Q = pass1["key.sums"] / pass1["key.weights"][..., None, None]  # [L, H_kv, D, D] float64
    L, H = rot.k_clip.shape
    noise = [0.0] * L
    for layer in range(L):
        k = heldout[f"{layer}.k"]  # [S, H_kv, T, D] unrotated held-out keys
        for h in range(H):
            M = rot.k_rotation[layer, h]
            rows = k[:, h].reshape(-1, k.shape[-1]).float() @ M  # [S·T, D] as the cache stores them
            errors = []
            for r in grid:
                dk = (R.fake_quant(rows, r) - rows).double() @ M.double().T
                errors.append(torch.einsum("nd,de,ne->n", dk, C_Q[layer, h], dk).mean().item())
            noise[layer] += errors[grid.index(1.0)]
            assert max(errors) > 1.5 * min(errors), (layer, h, errors)
            if key_bits is not None and key_bits[layer] == 3:
                assert rot.k_clip[layer, h].item() == 1.0
                continue
            chosen = min(range(len(grid)), key=lambda i: abs(grid[i] - rot.k_clip[layer, h].item()))
            assert errors[chosen] <= min(errors) * (1 + 1e-6), (layer, h, grid[chosen], errors)
    if key_bits is not None:
        loudest = sorted(range(L), key=lambda i: -noise[i])[: round(0.7 * L)]
        assert [3 if i in loudest else 2 for i in range(L)] == key_bits, (noise, key_bits)


def test_calibrate_writes_a_checked_artifact_folder(calibrated, run_cli, tiny_model_dir, text_file, tmp_path):
    out, summary = calibrated
    manifest, rot = load_artifacts(out)
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "rotations.safetensors"]
    assert manifest.model.num_kv_heads == 2 and manifest.rotation.granularity.value == "per-head"
    assert rot.k_rotation.shape == (2, 2, 64, 64) and rot.k_clip.shape == (2, 2)
    for clips in (rot.k_clip, rot.v_clip):  # values come from the grid (stored as float32)
        assert all(min(abs(c - g) for g in manifest.clip.grid) < 1e-6 for c in clips.flatten().tolist())
    assert manifest.key_bits.count(3) == 1 and summary["key_bits"] == manifest.key_bits  # round(0.7·2) layers
    _check_k_clips_minimise_the_logit_error(tmp_path / "cache", rot, manifest.clip.grid, manifest.key_bits)
    assert manifest.calibration.tokens == 256 and manifest.calibration.sequences == 4
    # head_dim 64: history V 2 + 32/64, K 2.5 + 32/64 (one layer of two at 3 bits), so 2.75 for K and V averaged;
    # 64 sink + 256 recent tokens at 16
    L = 131072
    assert manifest.bits_per_element["131072"] == pytest.approx((320 * 16 + (L - 320) * 2.75) / L, abs=1e-4)
    assert summary["forward_passes"] == ["pass1", "heldout", "pass2"] and len(summary["layers"]) == 2

    code, stdout, _ = run_cli("inspect", out)
    assert code == 0 and "rotations.safetensors" in stdout and "131,072" in stdout

    # same model, data and settings: the accumulators are reused, no forward pass runs; another clip mode neither
    code, stdout, _ = run_cli("calibrate", tiny_model_dir, "--dataset", text_file, *SMALL, "--out", out, "--json",
                              "--clip", "fixed", "--granularity", "per-layer", "--key-block", "0")
    again = json.loads(stdout)
    assert code == 0 and again["forward_passes"] == []
    manifest2, rot2 = load_artifacts(out)
    three = torch.tensor(manifest2.key_bits) == 3
    assert rot2.k_rotation.shape == (2, 1, 64, 64) and torch.all(rot2.k_clip[~three] == torch.tensor(0.96))
    assert torch.all(rot2.k_clip[three] == 1.0) and three.sum() == 1  # the 3-bit layer's keys are not clipped


def test_interrupted_calibration_resumes_to_the_same_result(tiny_model_dir, text_file, tmp_path):
    from oscar_zoo.texts import load_texts

    loaded = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    texts, source = load_texts(str(text_file))
    seqs = make_sequences(loaded.tokenizer, texts, 32, 6, 1, dataset=source)
    settings = CalibrationSettings(batch_size=2)
    reference = calibrate(loaded, seqs, settings, store_dir=tmp_path / "fresh")

    calls = []

    def interrupt_in_pass_two(desc, done, total, rate="", **fields):
        calls.append(desc)
        if desc.startswith("pass 2") and 0 < done < total:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        calibrate(loaded, seqs, settings, progress=interrupt_in_pass_two, store_dir=tmp_path / "resumed")
    store = AccumulatorStore(tmp_path / "resumed")
    assert store.progress(store.load("pass1"), "pass1_done") == 6
    assert 0 < store.progress(store.load("pass2"), "pass2_done") < 6
    resumed = calibrate(loaded, seqs, settings, store_dir=tmp_path / "resumed")
    assert resumed.forward_passes == ["pass2"]  # pass 1 and the held-out capture were finished and kept
    for name in ("k_rotation", "v_rotation", "k_eigenvalues", "v_eigenvalues", "k_clip", "v_clip"):
        a, b = getattr(reference.rotations, name), getattr(resumed.rotations, name)
        assert torch.allclose(a, b, atol=1e-5), name


def test_manifest_round_trip_and_tampering(calibrated, run_cli):
    out, _ = calibrated
    manifest = read_manifest(out)
    assert Manifest.from_json(manifest.to_json()) == manifest
    assert manifest.to_json() == (out / "manifest.json").read_text()

    bad = json.loads(manifest.to_json())
    bad["surprise"] = 1
    (out / "manifest.json").write_text(json.dumps(bad))
    code, _, err = run_cli("inspect", out)
    assert code == 4 and "surprise" in err and "Traceback" not in err

    bad = json.loads(manifest.to_json())
    bad["schema_version"] = 99
    (out / "manifest.json").write_text(json.dumps(bad))
    code, _, err = run_cli("inspect", out)
    assert code == 4 and "schema_version 99" in err

    (out / "manifest.json").write_text(manifest.to_json())
    data = bytearray((out / "rotations.safetensors").read_bytes())
    data[-10] ^= 0xFF
    (out / "rotations.safetensors").write_bytes(bytes(data))
    code, _, err = run_cli("inspect", out)
    assert code == 4 and "sha256" in err and len(err.strip().splitlines()) <= 3


def test_manifest_for_another_model_is_refused(calibrated):
    out, _ = calibrated
    manifest = read_manifest(out)
    other = manifest.model.replace(num_kv_heads=8, head_dim=128, id="other")
    with pytest.raises(IntegrityError) as exc:
        check_model_matches(manifest, other)
    assert exc.value.exit_code == 4 and "num_kv_heads" in str(exc.value) and "head_dim" in str(exc.value)


def _no_leftovers(folder):
    return not folder.exists() or not any(p.name.startswith(".") for p in folder.iterdir())


def test_bad_inputs_give_one_line_errors_and_leave_nothing(run_cli, tiny_model_dir, text_file, tmp_path, monkeypatch):
    monkeypatch.setenv("OSCAR_ZOO_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "outs" / "art"
    cases = [
        (["calibrate", "no-such-org/no-such-model", *SMALL], 2, "could not load model"),
        (["calibrate", str(tmp_path / "missing-folder"), *SMALL], 2, "does not exist"),
        (["calibrate", tiny_model_dir, "--dataset", tmp_path / "nope.parquet", *SMALL], 2, "does not exist"),
        (["calibrate", tiny_model_dir, "--dataset", tmp_path / "bad.parquet", *SMALL], 2, "could not read dataset"),
        (["calibrate", tiny_model_dir, "--dataset", text_file, *SMALL, "--tokens", "10000000"], 2, "sequences"),
        # calibrate's default sample (131,072 tokens: 256 sequences of 512) from a 20,000-character text: the count
        # it needs and the way out, one line
        (["calibrate", tiny_model_dir, "--dataset", text_file, "--heldout", "1", "--device", "cpu"], 2,
         "(256 calibration + 1 held-out)"),
        (["calibrate", tiny_model_dir, "--dataset", text_file, *SMALL, "--group-size", "48"], 2, "group_size"),
        (["calibrate", tiny_model_dir, "--dataset", text_file, *SMALL, "--granularity", "per-token"], 2, "granularity"),
        (["inspect", tmp_path / "nothing-here"], 2, "does not exist"),
    ]
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 this is not parquet")
    for args, code_expected, words in cases:
        code, stdout, err = run_cli(*args, "--out", out) if args[0] == "calibrate" else run_cli(*args)
        assert code == code_expected, (args, err)
        assert words in err, (args, err)
        assert "Traceback" not in err
        assert not out.exists() and _no_leftovers(out.parent), args


def test_unsupported_architecture_names_the_supported_ones(run_cli, tmp_path):
    from transformers import GPT2Config

    folder = tmp_path / "gpt2"
    folder.mkdir()
    (folder / "config.json").write_text(GPT2Config(n_layer=1, n_embd=32, n_head=2).to_json_string())
    code, _, err = run_cli("calibrate", folder, *SMALL, "--out", tmp_path / "art")
    assert code == 2 and "'gpt2' is not supported" in err and "qwen3" in err and "llama" in err
    assert not (tmp_path / "art").exists()


def test_existing_artifacts_survive_a_failed_recalibration(calibrated, run_cli, text_file, tmp_path):
    out, _ = calibrated
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    code, _, _ = run_cli("calibrate", tmp_path / "missing", *SMALL, "--out", out)
    assert code == 2
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    shutil.rmtree(out)


@pytest.fixture
def no_model_work(monkeypatch):
    """Refusals must come before any model work: loading the model fails the test."""
    from oscar_zoo.calibration import calibration_run

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before --out was checked")

    monkeypatch.setattr(calibration_run, "load_model", refuse)


def _tree(folder):
    return {p.relative_to(folder).as_posix(): (p.read_bytes() if p.is_file() else None) for p in folder.rglob("*")}


def test_out_refuses_a_folder_of_other_files_before_any_work(run_cli, tiny_model_dir, text_file, tmp_path,
                                                              no_model_work):
    thesis = tmp_path / "P"
    (thesis / "sub").mkdir(parents=True)
    (thesis / "thesis.tex").write_text("t\n")
    before = _tree(thesis)
    code, _, err = run_cli("calibrate", tiny_model_dir, "--dataset", text_file, *SMALL, "--out", thesis)
    assert code == 2, err
    assert "not an oscar-zoo artifact folder" in err and "nothing was changed" in err and "Traceback" not in err
    assert _tree(thesis) == before and sorted(p.name for p in tmp_path.iterdir()) == ["P", "corpus"]

    code, _, err = run_cli("calibrate", tiny_model_dir, "--dataset", text_file, *SMALL, "--out",
                           thesis / "thesis.tex" / "art")
    assert code == 2 and "which is a file" in err and _tree(thesis) == before

    # a manifest.json alone does not make a folder ours: its files must be exactly the ones the manifest lists
    (thesis / "manifest.json").write_text("{}")
    code, _, err = run_cli("calibrate", tiny_model_dir, "--dataset", text_file, *SMALL, "--out", thesis)
    assert code == 2 and "schema_version" in err and (thesis / "thesis.tex").read_text() == "t\n"


def test_out_dot_and_dotdot_are_checked_not_crashed(run_cli, tiny_model_dir, text_file, tmp_path, monkeypatch,
                                                    no_model_work):
    work = tmp_path / "work" / "inner"
    work.mkdir(parents=True)
    (work / "notes.txt").write_text("mine")
    monkeypatch.chdir(work)
    for out in (".", ".."):
        code, _, err = run_cli("calibrate", tiny_model_dir, "--dataset", text_file, *SMALL, "--out", out)
        assert code == 2 and "not an oscar-zoo artifact folder" in err and "Traceback" not in err, (out, err)
    assert (work / "notes.txt").read_text() == "mine" and sorted(p.name for p in work.parent.iterdir()) == ["inner"]


def test_out_replaces_only_a_recognisable_artifact_folder(calibrated, run_cli, tiny_model_dir, text_file, tmp_path,
                                                         monkeypatch):
    out, _ = calibrated
    (out / "plot.png").write_bytes(b"not ours")  # an artifact folder plus a file its manifest does not list
    before = _tree(out)
    code, _, err = run_cli("calibrate", tiny_model_dir, "--dataset", text_file, *SMALL, "--out", out)
    assert code == 2 and "plot.png" in err and _tree(out) == before
    (out / "plot.png").unlink()

    # the current folder is never swapped away from under the shell, even when it is an artifact folder
    monkeypatch.chdir(out)
    code, _, err = run_cli("calibrate", tiny_model_dir, "--dataset", text_file, *SMALL, "--out", ".")
    assert code == 2 and "current folder" in err
    monkeypatch.chdir(tmp_path)

    # through a symlink: the target folder is replaced, the link stays, nothing is left beside either
    link = tmp_path / "links" / "art"
    link.parent.mkdir()
    link.symlink_to(out)
    code, _, err = run_cli("calibrate", tiny_model_dir, "--dataset", text_file, *SMALL, "--out", link, "--clip",
                           "fixed")
    assert code == 0, err
    assert link.is_symlink() and link.resolve() == out.resolve()
    assert read_manifest(out).clip.mode.value == "fixed"
    assert [p.name for p in link.parent.iterdir()] == ["art"]
    assert not [p.name for p in out.parent.iterdir() if p.name.startswith(".")]


def test_calibrate_defaults_to_uncentred_and_centring_mean_still_writes_means(calibrated, run_cli, tiny_model_dir,
                                                                              text_file, tmp_path):
    """No --centring flag: the uncentred codec (benchmarks/notes/2026-12-01-codec-v2-centring.md: centring loses
    needle retrieval) — a schema-2 manifest recording quant.centring "none", no k_mean/v_mean tensors, a cache without
    means. `--centring mean` (the same accumulators, no forward pass) still writes the centred codec: the means, the
    manifest saying so, a centred cache."""
    from oscar_zoo.runtime.cache import OscarCache

    out, summary = calibrated
    manifest, rot = load_artifacts(out)
    assert summary["centring"] == "none"
    assert manifest.schema_version == 5 and manifest.quant.centring == "none" and not manifest.centred
    assert rot.k_mean is None and rot.v_mean is None
    assert not {"k_mean", "v_mean"} & set(load_tensors(out / "rotations.safetensors"))
    assert not OscarCache.from_folder(out).centred

    centred = tmp_path / "centred"
    code, stdout, err = run_cli("calibrate", tiny_model_dir, "--dataset", text_file, *SMALL, "--out", centred,
                                "--json", "--centring", "mean", "--key-block", "0")
    assert code == 0, err
    again = json.loads(stdout)
    assert again["forward_passes"] == [] and again["centring"] == "mean"
    manifest, rot = load_artifacts(centred)
    assert manifest.schema_version == 5 and manifest.quant.centring == "mean" and manifest.centred
    assert rot.k_mean.shape == rot.v_mean.shape == (2, 2, 64)
    assert rot.k_mean.abs().max() > 0 and rot.v_mean.abs().max() > 0
    assert OscarCache.from_folder(centred).centred


def test_calibrate_pin_writes_schema_4_pins_and_the_runtime_reads_them(calibrated, run_cli, tiny_model_dir,
                                                                       text_file, tmp_path):
    """The default pins nothing (no `pin` field, a cache that pins nothing); `--pin 32` writes quant.pin (schema 4,
    docs/format.md §6c), counted as BF16 in its bits per element, and `OscarCache.from_folder` builds a cache that pins
    them; export refuses the pinning artifact without --accept-degraded, and warns with it."""
    from oscar_zoo.format import layout
    from oscar_zoo.runtime.cache import OscarCache

    out, _ = calibrated
    assert '"pin"' not in (out / "manifest.json").read_text() and load_artifacts(out)[0].pin == 0
    assert {layer.pin for layer in OscarCache.from_folder(out).layers} == {0}

    pinned = tmp_path / "pinned"  # INT2 keys everywhere, so that pinning is the only thing export cannot carry
    code, _, err = run_cli("calibrate", tiny_model_dir, "--dataset", text_file, *SMALL, "--out", pinned, "--pin", "32",
                           "--key-bits", "2", "--key-block", "0")
    assert code == 0, err
    manifest, _ = load_artifacts(pinned)
    G = manifest.quant.group_size
    assert manifest.schema_version == 5 and manifest.quant.pin == manifest.pin == 32
    want = layout.kv_bits_per_element(32768, G, 64, 256, manifest.key_bits, 32)
    assert manifest.bits_per_element["32768"] == round(want, 4) == round(manifest.bits_at(32768), 4)
    # 32 BF16 tokens in place of 32 INT2 history tokens (2 + 32/64 bits): (16 − 2.5) · 32 / 32768 more per element
    unpinned = layout.kv_bits_per_element(32768, G, 64, 256, manifest.key_bits)
    assert want - unpinned == pytest.approx((16 - 2.5) * 32 / 32768)
    assert {layer.pin for layer in OscarCache.from_folder(pinned).layers} == {32}

    code, _, err = run_cli("export", pinned, "--format", "oscar-pt", "--out", tmp_path / "pt", "--average-heads")
    assert code == 2 and "pins 32 history tokens" in err and not (tmp_path / "pt").exists(), err
    code, _, err = run_cli("export", pinned, "--format", "oscar-pt", "--out", tmp_path / "pt", "--average-heads",
                           "--accept-degraded")
    assert code == 0 and "the reference runtime pins none" in err, err


def test_calibrate_default_codes_keys_per_channel(run_cli, tiny_model_dir, text_file, tmp_path, monkeypatch):
    """No codec flags: keys per channel over 64-token blocks (head_dim 64; docs/format.md §6d), unclipped keys and
    values, 3-bit keys in the loudest layers, flush one block: a schema-5 manifest whose bits per element count one
    pair per channel and block, and `OscarCache.from_folder` serves it so; export refuses it without
    --accept-degraded; `--key-block 128` is honoured and `--key-block 48` refused."""
    from oscar_zoo.runtime.cache import OscarCache

    monkeypatch.setenv("OSCAR_ZOO_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "chan"
    code, stdout, err = run_cli("calibrate", tiny_model_dir, "--dataset", text_file, *SMALL, "--out", out, "--json")
    assert code == 0, err
    manifest, rot = load_artifacts(out)
    q = manifest.quant
    assert manifest.schema_version == 5 and (q.key_block, q.flush, q.group_size, manifest.key_block) == (64, 64, 64, 64)
    assert manifest.clip.mode.value == "fixed" and manifest.clip.grid == []
    assert torch.equal(rot.k_clip, torch.ones_like(rot.k_clip)) and torch.equal(rot.v_clip, torch.ones_like(rot.v_clip))
    assert manifest.key_bits.count(3) == 1  # round(0.7 · 2 layers)
    hist = 32768 - 320
    want = (hist * ((2.5 + 0.5) + 2.5) / 2 + 320 * 16) / 32768  # keys 2.5 bits + 0.5 of pairs, values 2 + 0.5
    assert manifest.bits_per_element["32768"] == round(want, 4) == round(manifest.bits_at(32768), 4)
    assert "keys per channel over 64-token blocks" in manifest.codec
    cache = OscarCache.from_folder(out)
    assert {layer.key_block for layer in cache.layers} == {64} and cache.quant_settings["flush"] == 64

    code, _, err = run_cli("export", out, "--format", "oscar-pt", "--out", tmp_path / "pt", "--average-heads")
    assert code == 2 and "per channel over 64-token blocks" in err and not (tmp_path / "pt").exists(), err
    code, _, err = run_cli("calibrate", tiny_model_dir, "--dataset", text_file, *SMALL, "--out", tmp_path / "c128",
                           "--key-block", "128")
    assert code == 0 and load_artifacts(tmp_path / "c128")[0].quant.key_block == 128, err
    code, _, err = run_cli("calibrate", tiny_model_dir, "--dataset", text_file, *SMALL, "--out", tmp_path / "bad",
                           "--key-block", "48")
    assert code == 2 and "--key-block 48" in err and not (tmp_path / "bad").exists(), err

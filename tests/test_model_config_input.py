"""A model folder whose config.json has values oscar-zoo cannot use is bad input (exit 2, one `error:` line naming the
field and the file), never a traceback: through `import-oscar --model` (which reads only the config) and `calibrate`
(which loads the model, refused here before any weight is read). Real folders, real CLI."""

from __future__ import annotations

import json

import pytest
import torch

from oscar_zoo.export.oscar_pt import K_FILE, V_FILE

L, D = 2, 64  # the geometry of tiny_config (6 query / 2 KV heads)


@pytest.fixture
def config_dir(tmp_path):
    """A config-only Llama folder (the test suite's tiny geometry); `mutate(**fields)` rewrites its config.json."""
    from .conftest import tiny_config

    folder = tmp_path / "model"
    tiny_config("llama").save_pretrained(folder)

    def mutate(**fields):
        path = folder / "config.json"
        config = json.loads(path.read_text())
        config.update(fields)
        path.write_text(json.dumps(config))
        return folder

    return mutate


@pytest.fixture(scope="module")
def reference_files(tmp_path_factory):
    """Valid published-schema K and V files for L layers of head_dim D, so that only the config can be wrong."""
    folder = tmp_path_factory.mktemp("ref")
    eye = torch.eye(D)
    eig = torch.arange(D, dtype=torch.float32)
    for name, objective in ((K_FILE, "qqt_r_h_pbr"), (V_FILE, "sst_r_h_pbr")):
        torch.save({"format_version": 1, "objective": objective, "source_grouping": "layer",
                    "layers": {i: {"layer_id": i, "rotation": eye.clone(), "eigenvalues": eig.clone()}
                               for i in range(L)}}, folder / name)
    return folder / K_FILE, folder / V_FILE


def _assert_input_error(code: int, out: str, err: str, *needles: str) -> None:
    """Exit 2, no traceback, and exactly one `error:` line holding every needle."""
    assert code == 2, (code, out, err)
    assert "Traceback" not in out + err, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])


# (config.json changes, what the error line must name): values the config parser accepts but the geometry cannot use
GEOMETRY = {
    "head_dim too small": ({"head_dim": 2}, ["head_dim 2", "multiple of 4"]),
    "head_dim not packable": ({"head_dim": 6}, ["head_dim 6", "multiple of 4"]),
    "head_dim zero": ({"head_dim": 0}, ["head_dim", "0", "positive integer"]),
    "no layers": ({"num_hidden_layers": 0}, ["num_hidden_layers", "0", "positive integer"]),
    "negative layers": ({"num_hidden_layers": -1}, ["num_hidden_layers", "-1"]),
    "a billion layers": ({"num_hidden_layers": 10**9}, ["num_hidden_layers", "1000000000", "up to 65,536"]),
    "negative kv heads": ({"num_key_value_heads": -2}, ["num_key_value_heads", "-2", "positive integer"]),
    "zero kv heads": ({"num_key_value_heads": 0}, ["num_key_value_heads", "0", "positive integer"]),
    "heads not grouped": ({"num_key_value_heads": 4}, ["num_attention_heads 6", "num_key_value_heads 4"]),
    "architecture not a name": ({"architectures": [5]}, ["architectures", "[5]"]),
    "architectures a string": ({"architectures": "LlamaForCausalLM"}, ["architectures", "'LlamaForCausalLM'"]),
    "rope theta a word": ({"rope_parameters": {"rope_theta": "abc", "rope_type": "default"}},
                          ["rope_parameters.rope_theta", "'abc'"]),
    "rope theta negative": ({"rope_parameters": {"rope_theta": -1.0, "rope_type": "default"}},
                            ["rope_parameters.rope_theta", "-1.0"]),
}


@pytest.mark.parametrize("case", list(GEOMETRY))
def test_import_oscar_refuses_unusable_geometry(run_cli, config_dir, reference_files, tmp_path, case):
    fields, needles = GEOMETRY[case]
    folder = config_dir(**fields)
    out = tmp_path / "art"
    code, stdout, err = run_cli("import-oscar", *reference_files, "--model", folder, "--out", out)
    _assert_input_error(code, stdout, err, str(folder / "config.json"), *needles)
    assert not out.exists()


# configs transformers itself refuses to parse (strict field types, its own arithmetic on 0 heads, a non-list
# layer_types), and geometry it parses but oscar-zoo cannot use: calibrate refuses them before any weight is read
CALIBRATE = {
    "heads as a string": ({"num_attention_heads": "6"}, ["num_attention_heads", "expected int"]),
    "zero heads, no head_dim": ({"num_attention_heads": 0, "head_dim": None}, ["ZeroDivisionError"]),
    "layers as a float": ({"num_hidden_layers": 2.5}, ["num_hidden_layers"]),
    "layer_types not a list": ({"layer_types": 5}, ["TypeError"]),
    "no layers": ({"num_hidden_layers": 0}, ["num_hidden_layers", "positive integer"]),
    "head_dim too small": ({"head_dim": 2}, ["head_dim 2"]),
    "architecture not a name": ({"architectures": [5]}, ["architectures"]),
}


@pytest.mark.parametrize("case", list(CALIBRATE))
def test_calibrate_refuses_a_bad_config_before_loading(run_cli, config_dir, tmp_path, monkeypatch, case):
    monkeypatch.setenv("OSCAR_ZOO_CACHE", str(tmp_path / "cache"))
    fields, needles = CALIBRATE[case]
    folder = config_dir(**fields)  # config only: reaching the weights would be an OSError about missing files
    out = tmp_path / "art"
    code, stdout, err = run_cli("calibrate", folder, "--device", "cpu", "--dtype", "float32", "--tokens", "256",
                                "--seq-len", "64", "--out", out)
    _assert_input_error(code, stdout, err, str(folder / "config.json"), *needles)
    assert not out.exists()


def test_verify_refuses_a_bad_model_config(run_cli, config_dir, reference_files, tmp_path):
    """verify --model loads through the same path: a config transformers refuses is one line too."""
    folder = config_dir()
    art = tmp_path / "art"
    code, _, err = run_cli("import-oscar", *reference_files, "--model", folder, "--out", art)
    assert code == 0, err
    config_dir(num_attention_heads="6")
    code, stdout, err = run_cli("verify", art, "--model", folder, "--device", "cpu", "--context", "384",
                                "--sequences", "1")
    _assert_input_error(code, stdout, err, str(folder / "config.json"), "num_attention_heads")


def test_good_configs_still_describe_their_geometry(config_dir):
    """The checks accept what real configs hold: no num_key_value_heads (multi-head), head_dim from hidden_size,
    a rope theta given as an int, no `architectures`."""
    from oscar_zoo.models import arch_info, load_config

    folder = config_dir(num_key_value_heads=None, head_dim=None, architectures=None,
                        rope_parameters={"rope_theta": 10000, "rope_type": "default"})
    info = arch_info(load_config(folder))
    assert (info.num_layers, info.num_q_heads, info.num_kv_heads, info.head_dim) == (L, 6, 6, 192 // 6)
    assert info.architecture == "LlamaForCausalLM" and info.rope_theta == 10000.0


@pytest.mark.parametrize("fields", [{"num_attention_heads": "6"}, {"num_attention_heads": 0, "head_dim": None}])
def test_import_oscar_refuses_a_config_transformers_rejects(run_cli, config_dir, reference_files, tmp_path, fields):
    folder = config_dir(**fields)
    code, stdout, err = run_cli("import-oscar", *reference_files, "--model", folder, "--out", tmp_path / "art")
    _assert_input_error(code, stdout, err, str(folder / "config.json"))


def test_a_config_nested_past_the_json_readers_depth_is_one_line(run_cli, config_dir, reference_files, tmp_path):
    folder = config_dir()
    path = folder / "config.json"
    path.write_text(path.read_text()[:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    code, stdout, err = run_cli("import-oscar", *reference_files, "--model", folder, "--out", tmp_path / "art")
    _assert_input_error(code, stdout, err, str(path), "RecursionError")


def test_model_names_a_manifest_cannot_record_are_refused_before_loading(run_cli, tiny_model_dir, tmp_path):
    """A model folder whose name holds a newline (it would end up in the manifest and in export's shell files) is
    one line, exit 2, before any weight is read; names with joiners (emoji, Persian) are recorded as they are."""
    import shutil

    from oscar_zoo.format.schema import line_breaker

    assert line_breaker("/data/مدل‌ها/llama") is None and line_breaker("models/👨‍💻/llama") is None
    assert line_breaker("org/\u202etiny") == "\u202e" and line_breaker("a\nb") == "\n"
    bad = tmp_path / "tiny\nmodel"
    shutil.copytree(tiny_model_dir, bad)
    code, out, err = run_cli("calibrate", bad, "--device", "cpu", "--tokens", "256", "--seq-len", "64",
                             "--out", tmp_path / "art")
    assert code == 2 and "cannot be recorded in a manifest" in err and "Traceback" not in err, err
    assert not (tmp_path / "art").exists()

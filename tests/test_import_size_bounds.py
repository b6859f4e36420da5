"""`oscar-zoo import-oscar`: a `.pt` file is judged by its zip archive's headers before anything in it is unpacked or
unpickled. A small deflated file whose records unpack past what the model's shapes allow (a storage, all of them, the
pickle, the number of records) is exit 4 with one line naming the record and the sizes; torch.load never runs and
nothing is written."""

from __future__ import annotations

import io
import zipfile

import pytest
import torch

from oscar_zoo.export.oscar_pt import K_FILE, V_FILE

from .hub.helpers import random_rotations, run_cli, save_tiny_llama

L, D, H_KV = 3, 16, 2


@pytest.fixture
def model_dir(tmp_path):
    return save_tiny_llama(tmp_path / "tiny-llama", L, H_KV, D)


@pytest.fixture
def loads(monkeypatch):
    """Every torch.load call, recorded (and still made)."""
    calls = []
    real = torch.load

    def load(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "load", load)
    return calls


def _layers(seed=1):
    rot = random_rotations(L, 1, D, seed=seed)[:, 0]
    return {i: {"layer_id": i, "rotation": rot[i].clone(), "eigenvalues": torch.arange(D) * 1.0} for i in range(L)}


def _saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _deflated(data: bytes, extra: dict[str, bytes] | None = None) -> bytes:
    """The same archive with every record deflated (and `extra` records added), as any zip tool can rewrite it."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info.filename))
        for name, content in (extra or {}).items():
            dst.writestr(name, content)
    return out.getvalue()


def _files(tmp_path, k_bytes):
    ref = tmp_path / "ref"
    ref.mkdir()
    (ref / K_FILE).write_bytes(k_bytes)
    (ref / V_FILE).write_bytes(_saved({"format_version": 1, "objective": "sst_r_h_pbr", "source_grouping": "layer",
                                       "layers": _layers(seed=2)}))
    return ref / K_FILE, ref / V_FILE


def _refused(result, out, *words):
    code, stdout, err = result
    assert code == 4 and "Traceback" not in err, (stdout, err)
    lines = err.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["error", "hint"], err
    for word in words:
        assert word in lines[0], err
    assert not out.exists()
    return lines[0]


def _import(k_file, v_file, model_dir, out):
    return run_cli("import-oscar", str(k_file), str(v_file), "--model", str(model_dir), "--out", str(out))


def test_a_deflated_storage_past_the_models_largest_tensor_is_refused_unread(tmp_path, model_dir, loads):
    big = torch.zeros(1024, 1024)  # 4 MiB unpacked, a few KiB deflated; the model's largest is 3·16·17·8 bytes
    k_bytes = _deflated(_saved({"format_version": 1, "objective": "qqt_r_h_pbr", "source_grouping": "layer",
                                "layers": {0: {"rotation": big}}}))
    assert len(k_bytes) < 64 << 10
    k_file, v_file = _files(tmp_path, k_bytes)
    line = _refused(_import(k_file, v_file, model_dir, tmp_path / "art"), tmp_path / "art", K_FILE,
                    f"{big.numel() * 4:,} bytes", "before loading")
    assert "data/0" in line, line
    assert loads == []


def test_records_that_fit_alone_but_not_together_are_refused(tmp_path, model_dir, loads):
    parts = {f"layer{i}": torch.zeros(200_000) for i in range(4)}  # 800 KB each: under one record's 1 MiB floor
    k_bytes = _deflated(_saved({"objective": "qqt_r_h_pbr", "layers": _layers(), **parts}))
    k_file, v_file = _files(tmp_path, k_bytes)
    _refused(_import(k_file, v_file, model_dir, tmp_path / "art"), tmp_path / "art", "in all")
    assert loads == []


def test_a_pickle_that_unpacks_to_megabytes_is_refused(tmp_path, model_dir, loads):
    k_bytes = _deflated(_saved({"objective": "qqt_r_h_pbr", "layers": _layers(), "note": "x" * 4_000_000}))
    k_file, v_file = _files(tmp_path, k_bytes)
    _refused(_import(k_file, v_file, model_dir, tmp_path / "art"), tmp_path / "art", "data.pkl")
    assert loads == []


def test_an_archive_of_countless_records_is_refused(tmp_path, model_dir, loads):
    k_bytes = _deflated(_saved({"objective": "qqt_r_h_pbr", "layers": _layers()}),
                        extra={f"archive/extra/{i}": b"" for i in range(5000)})
    k_file, v_file = _files(tmp_path, k_bytes)
    _refused(_import(k_file, v_file, model_dir, tmp_path / "art"), tmp_path / "art", "records")
    assert loads == []


def test_a_file_larger_than_any_rotation_file_is_refused_unread(tmp_path, model_dir, loads):
    k_bytes = _saved({"objective": "qqt_r_h_pbr", "layers": _layers(), "pad": torch.zeros(2_000_000)})  # 8 MB, stored
    k_file, v_file = _files(tmp_path, k_bytes)
    _refused(_import(k_file, v_file, model_dir, tmp_path / "art"), tmp_path / "art", "bytes")
    assert loads == []


def test_the_legacy_format_is_refused_as_its_sizes_cannot_be_read_first(tmp_path, model_dir, loads):
    buf = io.BytesIO()
    torch.save({"objective": "qqt_r_h_pbr", "layers": _layers()}, buf, _use_new_zipfile_serialization=False)
    k_file, v_file = _files(tmp_path, buf.getvalue())
    _refused(_import(k_file, v_file, model_dir, tmp_path / "art"), tmp_path / "art", "not a zip archive")
    assert loads == []


def test_files_within_the_bounds_still_import(tmp_path, model_dir, loads):
    """Deflated records and storages shared between layers (views of one [L, D, D] tensor) are fine when they fit."""
    rot = random_rotations(L, 1, D, seed=1)[:, 0].double()  # float64, one storage for every layer
    k_bytes = _deflated(_saved({"format_version": 1, "objective": "qqt_r_h_pbr", "source_grouping": "layer",
                                "layers": {i: {"rotation": rot[i]} for i in range(L)}}))
    k_file, v_file = _files(tmp_path, k_bytes)
    code, _, err = _import(k_file, v_file, model_dir, tmp_path / "art")
    assert code == 0, err
    assert len(loads) == 2

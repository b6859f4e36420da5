"""`oscar-zoo calibrate`: every option checked before any work, a full disk or read-only destination as one line with
exit 2, and Ctrl-C saying what was kept and how to resume (issue 16)."""

import errno
import os
from contextlib import contextmanager

import pytest

from .test_calibrate_cli import SMALL, no_model_work, text_file  # noqa: F401 -- fixtures

pytestmark = pytest.mark.usefixtures("cache")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OSCAR_ZOO_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("extra, words", [
    (["--sink", "-5", "--recent", "-1"], "--sink -5: expected a number of full-precision sink tokens ≥ 0"),
    (["--recent", "-1"], "--recent -1: expected"),
    (["--sink", "100000"], "--sink + --pin + --recent 100000 + 0 + 256: expected less than 32,768 tokens"),
    (["--key-block", "0", "--pin", "32600"], "--sink + --pin + --recent 64 + 32600 + 256: expected less than 32,768"),
    (["--tokens", "0"], "--tokens 0: expected at least one sequence"),
    (["--seq-len", "3"], "--seq-len 3: expected at least 16"),
    (["--batch-size", "0"], "--batch-size 0: expected at least 1"),
    (["--heldout", "-1", "--clip", "fixed"], "--heldout -1: expected"),
    (["--heldout", "0"], "--heldout 0: expected ≥ 1 with --clip search"),
    (["--group-size", "-4"], "--group-size -4: expected 0"),
    (["--clip", "fixed", "--k-clip", "nan"], "--k-clip nan: expected a clip ratio"),
])
def test_nonsense_options_are_refused_before_any_work(run_cli, tiny_model_dir, text_file, tmp_path, no_model_work,
                                                      extra, words):
    out = tmp_path / "art"
    code, _, err = run_cli("calibrate", tiny_model_dir, "--dataset", text_file, *SMALL, *extra, "--out", out)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert lines[0].startswith("error: ") and words in lines[0] and "Traceback" not in err, err
    assert not out.exists()


def test_group_size_is_checked_against_the_head_dim_before_the_data_is_read(run_cli, tiny_model_dir, text_file,
                                                                          tmp_path, monkeypatch, cache):
    from oscar_zoo.calibration import calibration_run

    def no_data(*args, **kwargs):
        raise AssertionError("the dataset was read before --group-size was checked")

    monkeypatch.setattr(calibration_run, "load_texts", no_data)
    code, _, err = run_cli("calibrate", tiny_model_dir, "--dataset", text_file, *SMALL, "--group-size", "5",
                           "--out", tmp_path / "art")
    assert code == 2 and "--group-size 5: expected 0 or a divisor of the model's head_dim 64" in err, err
    assert not (tmp_path / "art").exists() and not (cache / "calibration").exists()


def test_unwritable_destination_is_refused_before_the_model_loads(run_cli, tiny_model_dir, text_file, tmp_path,
                                                                  monkeypatch, no_model_work):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)  # as root the bits do not stop writes: the OS is asked through os.access, faked here
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if str(p) == str(locked) else real_access(p, mode))
    code, _, err = run_cli("calibrate", tiny_model_dir, "--dataset", text_file, *SMALL, "--out", locked / "art")
    assert code == 2 and f"cannot write in {locked}" in err and "Traceback" not in err, err

    monkeypatch.setenv("OSCAR_ZOO_CACHE", str(locked / "cache"))
    code, _, err = run_cli("calibrate", tiny_model_dir, "--dataset", text_file, *SMALL, "--out", tmp_path / "art")
    assert code == 2 and "oscar-zoo cache" in err and f"cannot write in {locked}" in err, err
    locked.chmod(0o755)


def test_a_full_disk_while_writing_the_artifacts_is_exit_2_naming_the_path(run_cli, tiny_model_dir, text_file,
                                                                          tmp_path, monkeypatch):
    from oscar_zoo import artifacts

    real = artifacts.atomic_write_bytes
    out = tmp_path / "outs" / "art"

    def full_disk(path, data):
        if out.name in path.parent.name:  # the staging folder beside --out; the calibration cache still works
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, data)

    monkeypatch.setattr(artifacts, "atomic_write_bytes", full_disk)
    code, _, err = run_cli("calibrate", tiny_model_dir, "--dataset", text_file, *SMALL, "--out", out, "--clip",
                           "fixed")
    assert code == 2, err
    assert "Traceback" not in err and f"cannot write {out}" in err and "disk is full" in err, err
    assert not out.exists() and not list(out.parent.iterdir())  # the staging folder is gone too


def test_a_read_only_cache_while_checkpointing_is_exit_2_naming_the_path(run_cli, tiny_model_dir, text_file,
                                                                         tmp_path, monkeypatch, cache):
    def read_only(fd):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(os, "fsync", read_only)
    code, _, err = run_cli("calibrate", tiny_model_dir, "--dataset", text_file, *SMALL, "--out", tmp_path / "art")
    assert code == 2, err
    assert "Traceback" not in err and f"cannot write {cache / 'calibration'}" in err and "read-only" in err, err


def test_ctrl_c_says_what_was_kept_and_the_rerun_says_it_resumed(run_cli, tiny_model_dir, text_file, tmp_path,
                                                                monkeypatch, cache):
    from oscar_zoo.commands import calibrate as command

    @contextmanager
    def interrupt_in_pass_two(enabled=True):
        def report(desc, done, total, rate="", **fields):
            if desc.startswith("pass 2") and 0 < done < total:
                raise KeyboardInterrupt

        yield report

    out = tmp_path / "art"
    args = ["calibrate", tiny_model_dir, "--dataset", text_file, *SMALL, "--batch-size", "1", "--out", out]
    with monkeypatch.context() as m:
        m.setattr(command, "progress_reporter", interrupt_in_pass_two)
        code, _, err = run_cli(*args)
    assert code == 130
    (store,) = (cache / "calibration").iterdir()
    line = " ".join(err.split())
    assert f"interrupted: the calibration checkpoint is kept in {store}" in line, err
    assert "pass 1/2 (key target): 4 sequences done" in line and "re-run the same command to resume" in line, err
    assert not out.exists()

    code, _, err = run_cli(*args)
    assert code == 0, err
    line = " ".join(err.split())
    assert "pass 1/2: all 4 sequences reused from the checkpoint" in line, err
    assert f"pass 2/2: resuming from the checkpoint in {store} after" in line, err
    assert (out / "manifest.json").is_file()


@pytest.mark.parametrize("content", [b"caf\xe9 au lait\n" * 10, b"\x00\x01\x02\xff\xfe binary" * 10])
def test_a_dataset_file_that_is_not_utf8_is_named(tmp_path, content):
    from oscar_zoo.errors import InputError
    from oscar_zoo.texts import load_texts

    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "good.txt").write_text("fine text\n")
    (folder / "latin1.txt").write_bytes(content)
    with pytest.raises(InputError) as exc:
        load_texts(str(folder))
    assert f"dataset file {folder / 'latin1.txt'} is not UTF-8 text" in exc.value.message
    assert "DatasetGenerationError" not in exc.value.message and exc.value.exit_code == 2

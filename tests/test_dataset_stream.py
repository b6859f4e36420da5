"""`oscar-zoo calibrate --dataset F` where F never ends (/dev/zero, a `.txt` link to it, a FIFO, a folder holding
one) or is larger than any calibration can hold: exit 2 with one line naming the file, at once, before anything is
read; nothing is written. Each run is cut by an alarm, so a read that never ends fails the test instead of hanging."""

from __future__ import annotations

import os
import signal
from contextlib import contextmanager

import pytest

from oscar_zoo import texts

SECONDS = 120  # far more than loading the tiny model and refusing takes


class Endless(BaseException):
    """Raised by the alarm: not an Exception, so no handler on the way turns it into an error message."""


@contextmanager
def alarm(seconds):
    def ring(signum, frame):
        raise Endless(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, ring)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def streams(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "zero.txt").symlink_to("/dev/zero")
    os.mkfifo(folder / "pipe.jsonl")
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.txt").write_text("To be, or not to be, that is the question.\n" * 50)
    os.mkfifo(mixed / "b.txt")
    return {"/dev/zero": ("/dev/zero", "character device"),
            "link to /dev/zero": (folder / "zero.txt", "character device"),
            "FIFO": (folder / "pipe.jsonl", "FIFO"),
            "folder with a FIFO": (mixed, "FIFO")}


@pytest.mark.parametrize("case", ["/dev/zero", "link to /dev/zero", "FIFO", "folder with a FIFO"])
def test_a_dataset_that_never_ends_is_refused(case, streams, tiny_model_dir, run_cli, tmp_path, monkeypatch):
    monkeypatch.setenv("OSCAR_ZOO_CACHE", str(tmp_path / "cache"))
    dataset, kind = streams[case]
    with alarm(SECONDS):
        code, out, err = run_cli("calibrate", tiny_model_dir, "--device", "cpu", "--tokens", "256", "--seq-len", "64",
                                 "--clip", "fixed", "--dataset", dataset, "--out", tmp_path / "art")
    assert code == 2 and "Traceback" not in err, (out, err)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and kind in errors[0] and "not a regular file" in errors[0], err
    assert str(dataset) in errors[0] or os.fspath(streams[case][0]) in errors[0], err
    assert not (tmp_path / "art").exists()


def test_a_dataset_larger_than_the_bound_is_refused_unread(tmp_path):
    """A sparse file past MAX_DATASET_BYTES (it takes no disk space): refused from its size, no byte read."""
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:
        f.truncate(texts.MAX_DATASET_BYTES + 1)
    with alarm(SECONDS), pytest.raises(texts.InputError, match="more than the") as refused:
        texts.load_texts(str(big))
    assert f"{texts.MAX_DATASET_BYTES + 1:,} bytes" in refused.value.message


def test_a_file_that_grows_while_read_is_read_to_its_size_only(tmp_path, monkeypatch):
    """The UTF-8 check reads no more than the size the bound was checked on."""
    path = tmp_path / "t.txt"
    path.write_bytes(b"abc\n" * 10)
    read = []
    real_open = open

    class Growing:
        def __init__(self, f):
            self.f = f

        def read(self, n=-1):
            chunk = self.f.read(n) if n else b""
            read.append(len(chunk))
            return chunk or (b"\xff" * n if n else b"")  # an endless tail that is not even UTF-8

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr("builtins.open", lambda f, mode="r", *a, **k: Growing(real_open(f, mode, *a, **k))
                        if os.fspath(f) == str(path) else real_open(f, mode, *a, **k))
    with alarm(SECONDS):
        texts._check_utf8([path], [40])
    assert sum(read) == 40

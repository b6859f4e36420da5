"""AccumulatorStore's background checkpoints: a pass's last checkpoint is queued behind an in-flight write instead of
blocking the forward thread, the writes land in order, and a failed write surfaces at flush()."""

import threading

import pytest
import torch

from oscar_zoo.calibration.calibration_passes import AccumulatorStore


def _store(tmp_path, gate: threading.Event, order: list[str], fail: str | None = None):
    store = AccumulatorStore(tmp_path)
    real = store._write

    def write(name, tensors, state):
        if name == "first":
            assert gate.wait(600)  # held until the test lets it go (a hang guard, not a timing)
        if name == fail:
            raise OSError(f"disk full writing {name}")
        order.append(name)
        real(name, tensors, state)

    store._write = write
    return store


def test_last_checkpoint_is_queued_not_waited_for(tmp_path):
    gate, order = threading.Event(), []
    store = _store(tmp_path, gate, order)
    assert store.save_async("first", lambda: {"x": torch.ones(3)}, done=1)
    assert not store.save_async("skipped", lambda: {"x": torch.ones(3)}, done=2)  # in flight: a periodic one waits
    caller = threading.Thread(target=store.save_async, args=("last", lambda: {"x": torch.full((3,), 2.0)}, True),
                              kwargs={"done": 3})
    caller.start()
    caller.join(timeout=600)  # returns at once unless it waits for "first" (which waits for the gate): a hang guard
    assert not caller.is_alive() and order == []  # returned while "first" is still being written
    gate.set()
    store.flush()
    assert order == ["first", "last"]
    assert torch.equal(store.load("last")["x"], torch.full((3,), 2.0))
    assert store.progress(store.load("last"), "done") == 3


def test_a_failed_write_surfaces_at_flush_and_the_queued_one_is_dropped(tmp_path):
    gate, order = threading.Event(), []
    store = _store(tmp_path, gate, order, fail="first")
    store.save_async("first", lambda: {"x": torch.ones(3)})
    store.save_async("last", lambda: {"x": torch.ones(3)}, wait=True)
    gate.set()
    with pytest.raises(OSError, match="disk full writing first"):
        store.flush()
    assert order == [] and store.load("last") is None

"""Calibrate's progress: every capture pass's bar shows the time left for the whole run (all passes), at the rate
measured across the passes so far, not the time left in the pass that is running."""

import pytest
from rich.progress import Progress

from oscar_zoo.calibration import calibration_passes
from oscar_zoo.calibration.calibration_passes import HELDOUT, PASS1, PASS2, CalibrationSettings, PassesClock, calibrate
from oscar_zoo.console import TimeLeftColumn
from oscar_zoo.models import load_model
from oscar_zoo.texts import corpus_dir, load_texts, make_sequences


class Ticker:
    """A clock the test sets by hand."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_time_left_counts_every_planned_pass_at_the_run_s_rate():
    t = Ticker()
    clock = PassesClock(clock=t)
    clock.plan(PASS1, 4000)
    clock.plan(HELDOUT, 500)
    clock.plan(PASS2, 4000)
    clock.start(PASS1, 4000)
    assert clock.seconds_left() is None  # no batch yet: no rate
    t.now = 1.0
    clock.advance(PASS1, 1000)  # 1,000 tok/s
    assert clock.seconds_left() == pytest.approx(7.5)  # 3,000 + 500 + 4,000 tokens to go, not pass 1's 3 s
    t.now = 4.0
    clock.advance(PASS1, 3000)
    assert clock.seconds_left() == pytest.approx(4.5)
    t.now = 10.0  # between passes (the reduce, loading a checkpoint): not forward time
    clock.start(HELDOUT, 500)
    t.now = 10.5
    clock.advance(HELDOUT, 500)
    assert clock.seconds_left() == pytest.approx(4.0)  # 4,500 tokens in 4.5 s of passes
    t.now = 20.0
    clock.start(PASS2, 4000)
    t.now = 24.0
    clock.advance(PASS2, 2000)  # pass 2 runs slower (500 tok/s): the run's rate follows
    assert clock.seconds_left() == pytest.approx(2000 * 8.5 / 6500)
    t.now = 28.0
    clock.advance(PASS2, 2000)
    assert clock.seconds_left() == 0.0


def test_a_resumed_run_plans_only_what_is_left():
    t = Ticker()
    clock = PassesClock(clock=t)
    clock.plan(PASS1, 0)  # finished in an earlier run
    clock.plan(HELDOUT, 0)
    clock.plan(PASS2, 3000)
    clock.start(PASS2, 3000)
    t.now = 2.0
    clock.advance(PASS2, 1000)
    assert clock.seconds_left() == pytest.approx(4.0)


def test_the_bar_shows_the_run_s_time_left_where_reported():
    column = TimeLeftColumn()
    with Progress(disable=True) as progress:
        run = progress.add_task(PASS1, total=100, completed=10, run_left=3725.0)
        unknown = progress.add_task(PASS2, total=100, run_left=None)
        plain = progress.add_task("rotations", total=30, completed=30)
        tasks = {task.id: task for task in progress.tasks}
        assert column.render(tasks[run]).plain == "1:02:05 left in all passes"
        assert column.render(tasks[unknown]).plain == "-:--:-- left in all passes"
        assert "all passes" not in column.render(tasks[plain]).plain  # rich's own time remaining


@pytest.mark.parametrize("replay", [True, False])
def test_calibrate_reports_the_whole_run_s_time_left_on_every_pass(replay, tiny_model_dir, tmp_path, monkeypatch):
    """Replayed from the keys and values pass 1 kept, pass 2 is no forward work to plan; run again, it is."""
    if not replay:
        monkeypatch.setattr(calibration_passes, "REPLAY_SHARE", 0.0)
    loaded = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    text = tmp_path / "play.txt"
    text.write_text((corpus_dir() / "coriolanus_gut.txt").read_text()[:20000])
    texts, source = load_texts(str(text))
    seqs = make_sequences(loaded.tokenizer, texts, 32, 6, 1, dataset=source)
    t = Ticker()

    def ticking() -> float:  # every look at the clock is one second later: each batch takes 1 s
        t.now += 1.0
        return t.now

    monkeypatch.setattr(calibration_passes, "PassesClock", lambda: PassesClock(clock=ticking))
    reports = []

    def progress(description, done, total, rate="", **fields):
        reports.append((description, done, total, fields))

    calibrate(loaded, seqs, CalibrationSettings(batch_size=2), progress=progress, store_dir=tmp_path / "store")
    passes = [r for r in reports if r[0] in (PASS1, HELDOUT, PASS2)]
    assert {r[0] for r in passes} == {PASS1, HELDOUT, PASS2}
    assert all("run_left" in r[3] for r in passes)
    T, heldout_tokens = seqs.input_ids.shape[1], seqs.heldout_ids.numel()
    first_batch = next(r for r in passes if r[0] == PASS1 and r[1] > 0)
    # one batch of 2 sequences in 1 s; left: the rest of pass 1, the held-out capture and (run again) all of pass 2
    left = (6 - 2) * T + heldout_tokens + (0 if replay else 6 * T)
    assert first_batch[3]["run_left"] == pytest.approx(left / (2 * T))
    assert passes[-1][0] == PASS2 and passes[-1][3]["run_left"] == 0.0

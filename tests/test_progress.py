import io
import time

import pytest
from rich.console import Console

from selfrl.run.progress import ProgressLog, RichProgress


def test_log_lines_are_text_not_rich_markup():
    """The no-signal hint names "[task] options"; rich read it as markup and printed "( options)"."""
    out = io.StringIO()
    with RichProgress(1, console=Console(file=out, width=200)) as p:
        p.log("choose an easier subset ([task] options)")
    assert "([task] options)" in out.getvalue()


def test_log_lines_carry_no_source_path():
    """Every line of a run ended in "progress.py:67", rich's log_path: noise that named only this module."""
    p = RichProgress(1)
    p.bars.console.file = out = io.StringIO()
    p.bars.console.width = 200
    p.log("iteration 0: reward 0.5")
    assert "iteration 0: reward 0.5" in out.getvalue()
    assert "progress.py" not in out.getvalue()


def test_the_iteration_bar_shows_the_time_left():
    """Two iterations done in 2 minutes of 4: the iteration bar says about 2 minutes are left
    (rich's default 30 s speed window would hold no step of a run and show no estimate)."""
    now = [1000.0]
    p = RichProgress(4, console=Console(file=io.StringIO(), width=200))
    p.bars.get_time = lambda: now[0]
    with p:
        p.phase("rollouts", 8)
        for _ in range(2):
            now[0] += 60.0
            p.iteration_done(_)
        out = io.StringIO()
        Console(file=out, width=200).print(p.bars.get_renderable())
    line = next(x for x in out.getvalue().splitlines() if x.startswith("iterations"))
    assert "2/4" in line and "eta 0:02:00" in line


class Recorder:
    """A display that keeps what it is told."""

    def __init__(self, interactive):
        self.interactive, self.lines, self.steps = interactive, [], 0

    def log(self, message):
        self.lines.append(message)

    def phase(self, description, total):
        self.lines.append(f"phase {description} {total}")

    def advance(self, steps=1):
        self.steps += steps


def test_every_line_is_in_the_file_at_once(tmp_path):
    """With output sent to a file, nothing showed during a 16-minute validation: the lines are in
    RUN_DIR/progress.log, each readable as soon as it is logged (no buffering to the end)."""
    inner = Recorder(interactive=True)
    p = ProgressLog(inner, tmp_path / "progress.log")
    p.log("base model: held-out success 0.070 on 128 tasks (55 s)")
    assert (tmp_path / "progress.log").read_text().rstrip().endswith("base model: held-out success 0.070 on 128 tasks (55 s)")
    p.log("iteration 0: reward 0.5")
    p.close()
    lines = (tmp_path / "progress.log").read_text().splitlines()
    assert [ln.split(" ", 2)[2] for ln in lines] == ["base model: held-out success 0.070 on 128 tasks (55 s)",
                                                     "iteration 0: reward 0.5"]  # after the date and time
    assert inner.lines == ["base model: held-out success 0.070 on 128 tasks (55 s)", "iteration 0: reward 0.5"]


@pytest.mark.parametrize("interactive", [True, False])
def test_a_long_phase_writes_a_heartbeat(tmp_path, interactive):
    """A line at least every heartbeat_s while a phase runs; on the screen too when no bar shows it."""
    now = [0.0]
    inner = Recorder(interactive)
    p = ProgressLog(inner, tmp_path / "progress.log", heartbeat_s=30, clock=lambda: now[0])
    p.phase("validation (version 0)", 128)
    now[0] = 29.0
    assert p.beat() is None  # not yet
    p.advance(64)
    now[0] = 95.0
    assert p.beat() == "validation (version 0): 64 of 128 done, 95 s"
    now[0] = 110.0
    assert p.beat() is None  # 15 s since the last line
    p.log("validation done")
    now[0] = 139.0
    assert p.beat() is None  # 29 s since the last line
    p.close()
    text = (tmp_path / "progress.log").read_text()
    assert "validation (version 0): 64 of 128 done, 95 s" in text and inner.steps == 64
    assert ("validation (version 0): 64 of 128 done, 95 s" in inner.lines) == (not interactive)


def test_the_heartbeat_thread_writes_and_stops(tmp_path):
    p = ProgressLog(Recorder(True), tmp_path / "progress.log", heartbeat_s=0.01)
    p.phase("iteration 0: rollouts (turns)", 3)
    for _ in range(1000):  # up to 10 s on a busy machine; a few ms on an idle one
        if "rollouts (turns): 0 of 3 done" in (tmp_path / "progress.log").read_text() if p.logger else False:
            break
        time.sleep(0.01)
    p.close()
    assert not p.thread.is_alive()
    assert "iteration 0: rollouts (turns): 0 of 3 done" in (tmp_path / "progress.log").read_text()


def test_the_file_rotates(tmp_path, monkeypatch):
    monkeypatch.setattr("selfrl.run.progress.LOG_MAX_BYTES", 200)
    p = ProgressLog(Recorder(True), tmp_path / "progress.log")
    for i in range(20):
        p.log(f"iteration {i}: reward 0.5")
    p.close()
    assert (tmp_path / "progress.log.1").exists() and "iteration 19" in (tmp_path / "progress.log").read_text()


def test_bad_heartbeat_is_refused(tmp_path):
    with pytest.raises(ValueError, match="heartbeat_s must be > 0"):
        ProgressLog(Recorder(True), tmp_path / "progress.log", heartbeat_s=0)

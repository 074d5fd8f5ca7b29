import io

from rich.console import Console

from selfrl.run.progress import RichProgress


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

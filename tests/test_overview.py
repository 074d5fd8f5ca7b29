"""The overview figure, `selfrl report`, `selfrl compare` and the serving report.

Most stores here are written by hand through the store's public API with a fake clock,
so that every place on the figure is known: the run below validates the base model
(2/10), runs iterations 0 and 1, is promoted at 5/10, has a collapse during iteration 2,
a rejected candidate (4/10) after iteration 3 (recorded as the old kind ``rollback``),
is killed, resumed an hour later, and promoted at 7/10 after iteration 5.
"""

from __future__ import annotations

import sqlite3
from types import SimpleNamespace

import pytest

import selfrl.record.store as store_module
from selfrl.cli import main
from selfrl.report.compare import compare_runs
from selfrl.report.figures import PANELS, overview_figure
from selfrl.report.run import rebuild_report
from selfrl.record import served as records
from selfrl.record.store import Store
from selfrl.report.timeline import Mark, event_mark, load_timeline
from selfrl.core.trajectory import Trajectory

VAL = [f"v{i}" for i in range(10)]


@pytest.fixture
def clock(monkeypatch):
    """A settable clock for everything the store timestamps."""
    c = SimpleNamespace(t=0.0)
    c.time = lambda: c.t
    monkeypatch.setattr(store_module, "time", c)
    monkeypatch.setattr(records, "time", c)
    return c


def trajs(n: int, version: int = 0) -> list[Trajectory]:
    return [Trajectory(task_id="t", group_id="g", adapter_version=version, prompt_len=1, token_ids=[1, 2],
                       completion_mask=[0, 1], logprobs=[0.0, -1.0]) for _ in range(n)]


def build_run(db, clock, kl_scale: float = 1.0, finals: dict | None = None) -> None:
    """The run of the module docstring. ``finals``: version -> (status, {task: solved})
    recorded as extra versions (parent 0) for the compare test."""
    s = Store(db)
    clock.t = 1000.0
    config = {"model": {"name": "tiny"}, "train": {"beta": 0.02 * kl_scale}, "run_dir": str(db.parent)}
    run = s.start_run(config)
    s.add_tasks([{"id": t, "question": "q"} for t in VAL], "val")
    s.add_version(0, None, "/a/0", "base", {"val/success": 0.2})
    s.add_evaluation(0, [(t, i < 2, None) for i, t in enumerate(VAL)])
    clock.t = 1020.0
    s.log_metrics(run, 0, {"time/validation_s": 20.0})
    s.log_metrics(run, 0, {"val/success": 0.2})

    def iteration(step, t):
        clock.t = t - 5
        s.add_trajectories(run, step, trajs(8))
        clock.t = t
        s.log_metrics(run, step, {"kl": 0.01 * step * kl_scale, "reward/mean": 0.1 * step, "train/correct": 0.05 * step,
                                  "train/tool_use": 0.1, "frac_reward_zero_std": 0.5,
                                  "time/rollout_s": 30.0, "time/update_s": 10.0})

    def validation(step, t, success):
        clock.t = t
        s.log_metrics(run, step, {"time/validation_s": 20.0})
        s.log_metrics(run, step, {"val/success": success})

    iteration(0, 1060.0)
    iteration(1, 1100.0)
    validation(1, 1120.0, 0.5)
    clock.t = 1121.0
    s.log_event(run, "promote", "version 2 promoted: held-out 0.500 (best was 0.200)")
    clock.t = 1150.0
    s.log_event(run, "collapse", "iteration 2: collapse: reward dropped")
    iteration(2, 1160.0)
    iteration(3, 1200.0)
    validation(3, 1220.0, 0.4)
    clock.t = 1221.0
    s.log_event(run, "rollback", "version 4 rejected: held-out 0.400 < best 0.500 - 0.02; serving version 2 again")
    clock.t = 4600.0  # killed at 1221; resumed an hour later
    run = s.start_run(config)
    s.log_event(run, "resume", "resumed at iteration 4 from version 2")
    s.log_metrics(run, 4, {"val/success": 0.5})
    iteration(4, 4640.0)
    iteration(5, 4680.0)
    validation(5, 4700.0, 0.7)
    clock.t = 4701.0
    s.log_event(run, "promote", "version 6 promoted")
    for version, (status, results) in (finals or {}).items():
        s.add_version(version, 0, f"/a/{version}", status, {"val/success": sum(results.values()) / len(results)})
        s.add_evaluation(version, [(t, ok, None) for t, ok in results.items()])
    s.close()


def gids(ax, prefix: str) -> list:
    return [a for a in ax.get_children() if (a.get_gid() or "").startswith(prefix)]


def test_event_kinds_are_read_through_one_table():
    assert event_mark("promote", "version 2 promoted") is Mark.PROMOTE
    assert event_mark("reject", "version 4 rejected") is Mark.REJECT
    assert event_mark("rollback", "version 4 rejected: held-out 0.4 < best 0.5") is Mark.REJECT  # stores before the enum
    assert event_mark("rollback", "rolled back to version 2; versions [3] marked rolled_back") is Mark.ROLLBACK
    assert event_mark("collapse", "iteration 2: collapse") is Mark.COLLAPSE
    assert event_mark("resume", "resumed") is None


def test_timeline_places_values_and_events_on_three_axes(tmp_path, clock):
    build_run(tmp_path / "selfrl.db", clock)
    with Store(tmp_path / "selfrl.db", readonly=True) as s:
        tl = load_timeline(s, "run")
    # (updates applied, rollouts stored, recorded seconds): the hour between the sessions is left out,
    # so the resumed session starts at 221 s, where the first one's last record (1221) ended.
    assert [(h.at.update, h.at.rollouts, h.at.elapsed_s, h.k, h.n) for h in tl.heldout] == [
        (0, 0, 20.0, 2, 10), (2, 16, 120.0, 5, 10), (4, 32, 220.0, 4, 10), (4, 32, 221.0, 5, 10),
        (6, 48, 321.0, 7, 10)]
    # 5/10: Wilson [0.237, 0.763]
    assert (round(tl.heldout[1].low, 3), round(tl.heldout[1].high, 3)) == (0.237, 0.763)
    assert (tl.base.k, tl.base.n) == (2, 10)
    assert [e.mark for e in tl.events] == [Mark.PROMOTE, Mark.COLLAPSE, Mark.REJECT, Mark.PROMOTE]
    promote, collapse, reject, last = tl.events
    # The promotion at 1121 s lies between the validation row (1120: update 2, 16 rollouts) and
    # iteration 2's rows (1160: update 2, 24 rollouts): 16 + 8 * 1/40 rollouts.
    assert (promote.at.update, promote.at.rollouts, promote.at.elapsed_s) == (2.0, 16.2, 121.0)
    assert (collapse.at.update, collapse.at.rollouts) == (2.0, 22.0)  # 16 + 8 * 30/40
    assert (reject.at.update, reject.at.elapsed_s) == (4.0, 221.0)
    assert (last.at.update, last.at.rollouts, last.at.elapsed_s) == (6.0, 48.0, 322.0)  # after the last row: held
    assert tl.xy("reward/mean", "update") == ([0, 1, 2, 3, 4, 5], [0.0, 0.1, 0.2, 0.30000000000000004, 0.4, 0.5])
    assert (tl.updates, tl.rollouts, tl.elapsed_s) == (6, 48, 322.0)


def test_overview_figure_has_the_panels_band_and_event_markers(tmp_path, clock):
    build_run(tmp_path / "selfrl.db", clock)
    with Store(tmp_path / "selfrl.db", readonly=True) as s:
        fig = overview_figure([load_timeline(s, "run")], "update")
    axes = fig.axes
    assert [ax.get_title() for ax in axes] == [p.format(x="updates applied") for p in PANELS]
    for ax in axes:  # every panel: 2 promotions, 1 rejection, 1 collapse, each a line and a symbol
        for mark, n in (("promote", 2), ("reject", 1), ("collapse", 1), ("rollback", 0)):
            assert len(gids(ax, f"event-line:{mark}")) == n, (ax.get_title(), mark)
            assert len(gids(ax, f"event-symbol:{mark}")) == n, (ax.get_title(), mark)
    wall, updates = axes[0], axes[1]
    for ax in (wall, updates):
        assert len(gids(ax, "heldout-band")) == 1
        (base,) = gids(ax, "base-level")
        assert list(base.get_ydata()) == [0.2, 0.2]
    # the promotions sit on the validations that decided them: updates 2 and 6
    assert sorted(line.get_xdata()[0] for line in gids(updates, "event-line:promote")) == [2.0, 6.0]
    # wall-clock in minutes (322 s > 3 min): the rejection at 221 s
    assert gids(wall, "event-line:reject")[0].get_xdata()[0] == pytest.approx(221 / 60)
    for ax in axes[1:]:  # integer axes get integer ticks
        assert all(float(t).is_integer() for t in ax.get_xticks())
    band = gids(updates, "heldout-band")[0]
    low = band.get_paths()[0].vertices[:, 1].min()
    assert low == pytest.approx(0.0567, abs=1e-4)  # Wilson 2/10 lower bound, the lowest of the band


def test_no_validation_no_band(tmp_path):
    with Store(tmp_path / "selfrl.db") as s:
        run = s.start_run({})
        for step in range(3):
            s.log_metrics(run, step, {"reward/mean": 0.1 * step, "kl": 0.0})
        fig = overview_figure([load_timeline(s, "run")], "update")
    assert not any(gids(ax, "heldout-band") for ax in fig.axes)
    assert not any(gids(ax, "event-") for ax in fig.axes)
    assert len(fig.axes) == 6


def test_a_run_killed_before_its_first_update(tmp_path):
    with Store(tmp_path / "selfrl.db") as s:
        run = s.start_run({})
        s.add_version(0, None, "/a/0", "base", {"val/success": 0.5})
        s.log_metrics(run, 0, {"time/validation_s": 3.0})
        s.log_metrics(run, 0, {"val/success": 0.5})
        tl = load_timeline(s, "run")
    assert (tl.updates, tl.rollouts) == (0, 0)
    assert [(h.at.update, h.at.value, h.n) for h in tl.heldout] == [(0, 0.5, None)]  # no task list: no interval
    assert (tl.base.at.value, tl.base.n) == (0.5, None)
    assert main(["report", str(tmp_path)]) == 0
    assert "![overview](plots/overview.png)" in (tmp_path / "report.md").read_text()


def test_selfrl_report_rebuilds_from_the_store_while_a_writer_holds_it(tmp_path, clock):
    run_dir = tmp_path / "run"
    build_run(run_dir / "selfrl.db", clock)
    writer = sqlite3.connect(run_dir / "selfrl.db")
    writer.execute("BEGIN IMMEDIATE")  # a run in progress, in the middle of a write
    writer.execute("INSERT INTO events (run_id, time, kind, message, data_json) VALUES (2, 1, 'promote', 'x', '{}')")
    try:
        assert main(["report", str(run_dir), "--out", str(tmp_path / "out")]) == 0
    finally:
        writer.rollback()
        writer.close()
    text = (tmp_path / "out" / "report.md").read_text()
    assert text.index("![overview](plots/overview.png)") < text.index("## Held-out success")
    assert (tmp_path / "out" / "plots" / "overview.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| promotions | 2 |" in text and "| rejections | 1 |" in text and "| collapse_events | 1 |" in text
    assert "| sessions | 2 |" in text
    assert not (run_dir / "report.md").exists()  # --out: nothing written into the run folder
    assert main(["report", str(tmp_path / "nothing")]) == 2


def test_selfrl_compare_writes_figures_and_the_paired_table(tmp_path, clock):
    a = dict(zip(VAL, [True, True, False, False, True, False, True, False, False, True]))  # 5/10
    b = dict(zip(VAL[:8], [True, True, True, False, True, True, False, True]))  # 6/8, on v0..v7 only
    build_run(tmp_path / "lr-a" / "selfrl.db", clock, finals={1: ("rejected", {"v0": False}), 2: ("promoted", a)})
    build_run(tmp_path / "lr-b" / "selfrl.db", clock, kl_scale=2.0, finals={3: ("promoted", b)})
    out = tmp_path / "cmp"
    assert main(["compare", str(tmp_path / "lr-a"), str(tmp_path / "lr-b"), "--out", str(out)]) == 0
    text = (out / "compare.md").read_text()
    # Wilson 5/10 = [0.237, 0.763]; 6/8: center (0.75 + 0.2401) / 1.4802 = 0.6689,
    # half 1.96 / 1.4802 * sqrt(0.75 * 0.25 / 8 + 3.8416 / 256) = 0.2596 -> [0.409, 0.929]
    assert "| lr-a | 2 | 5/10 = 0.500 [0.237, 0.763] | 2/10 = 0.200 [0.057, 0.510] | 6 | 48 | 5.4 min |" in text
    assert "| lr-b | 3 | 6/8 = 0.750 [0.409, 0.929] |" in text
    # shared v0..v7: a = 1,1,0,0,1,0,1,0; b = 1,1,1,0,1,1,0,1; d = b - a = 0,0,1,0,0,1,-1,1
    # mean 2/8 = 0.25; s^2 = (4 * 0.0625 + 3 * 0.5625 + 1.5625) / 7 = 0.5; half = 1.96 * sqrt(0.5 / 8) = 0.49
    assert "| lr-b | 8 | +0.250 [-0.240, +0.740] |" in text
    assert "| train.beta | 0.02 | 0.04 |" in text and "| run_dir |" not in text  # the settings that differ
    for png in ("compare_rollouts.png", "compare_wallclock.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"({png})" in text
    with Store(tmp_path / "lr-a" / "selfrl.db", readonly=True) as sa, Store(tmp_path / "lr-b" / "selfrl.db",
                                                                             readonly=True) as sb:
        fig = overview_figure([load_timeline(sa, "lr-a"), load_timeline(sb, "lr-b")], "rollouts")
    kl = fig.axes[3]
    lines = [ln for ln in kl.get_lines() if not (ln.get_gid() or "").startswith("event")]
    assert len({ln.get_color() for ln in lines}) == 2  # one colour per run
    assert sorted(ln.get_ydata()[-1] for ln in lines) == pytest.approx([0.05, 0.10])
    assert list(lines[0].get_xdata()) == [8, 16, 24, 32, 40, 48]  # against rollouts
    assert len(gids(kl, "event-line:promote")) == 4  # two per run
    assert main(["compare", str(tmp_path / "lr-a")]) == 2


def test_serve_report_shows_versions_feedback_and_gate_results(tmp_path, clock):
    run_dir = tmp_path / "serve"
    s = Store(run_dir / "selfrl.db")
    records.init(s)
    clock.t = 100.0
    run = s.start_run({"serve": {"served_model_name": "m"}})
    s.add_version(0, None, "/a/0", "base", {"val/success": 0.2})
    s.add_evaluation(0, [(t, i < 2, None) for i, t in enumerate(VAL)])
    for i in range(4):  # four turns on version 0
        clock.t = 110.0 + i
        t = trajs(1, version=0)[0]
        records.add_turn(s, run, t, f"r{i}", 0, f"c{i}", "g", f"k{i}")
    clock.t = 120.0
    records.apply_feedback(s, "r0", 0, "explicit", 1.0, rating=1.0)
    records.apply_feedback(s, "r1", 0, "explicit", -1.0, rating=-1.0)
    clock.t = 130.0
    s.add_version(1, 0, "/a/1", "candidate", {})
    served = [tr for tr, _ in records.ready(s, 0.0, 10, now=200.0)]
    records.mark(s, served[:3], "trained", 1)
    s.add_evaluation(1, [(t, i < 6, None) for i, t in enumerate(VAL)])
    s.set_version_status(1, "promoted", {"val/success": 0.6})
    clock.t = 131.0
    s.log_event(run, "swap", "serving version 1 (promoted: held-out 0.600)", {"version": 1})
    clock.t = 140.0
    s.add_version(2, 1, "/a/2", "rejected", {"val/success": 0.3})
    s.add_evaluation(2, [(t, i < 3, None) for i, t in enumerate(VAL)])
    s.log_event(run, "reject", "version 2 rejected: held-out 0.300 < best 0.600 - 0.02")
    clock.t = 150.0
    records.add_turn(s, run, trajs(1, version=1)[0], "r9", 0, "c9", "g", "k9")
    s.close()
    assert main(["report", str(run_dir)]) == 0
    text = (run_dir / "report.md").read_text()
    assert "![serving overview](plots/serve_overview.png)" in text
    # 5 served; pending: r3 and r9 (r0-r2 trained); feedback on 2 turns, both trained
    assert "| 5 | 2 | 0 | 3 | 0 | 2 |" in text
    assert "| 1 | 0 | 30 s | 6/10 = 0.600 [0.313, 0.832] | passed the gate; served |" in text
    assert "| 2 | 1 | 40 s | 3/10 = 0.300 [0.108, 0.603] | failed the gate; never served |" in text
    assert (run_dir / "plots" / "serve_overview.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Store(run_dir / "selfrl.db", readonly=True) as s:
        assert [(e.mark, e.at.elapsed_s) for e in load_timeline(s, "serve").events] == [
            (Mark.PROMOTE, 31.0), (Mark.REJECT, 40.0)]
    with Store(run_dir / "selfrl.db") as s:  # a server that records 'promote' too: its swap is not marked again
        clock.t = 160.0
        s.log_event(run, "promote", "version 3 promoted")
        s.log_event(run, "swap", "serving version 3")
        assert [e.mark for e in load_timeline(s, "serve").events] == [Mark.REJECT, Mark.PROMOTE]


def short(traj, ctx):
    """Test reward: 1 for an immediate EOS, 0 at the token limit of both turns (24 tokens)."""
    return 1.0 - traj.num_completion_tokens / 24


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, tiny_tokenizer):
    """A real two-iteration run of the loop on a tiny Phi, validated after every update."""
    from conftest import save_tiny_phi

    from selfrl.config import RunConfig
    from selfrl.run.main import run
    from selfrl.envs.rewards import REWARD_FUNCS

    mp = pytest.MonkeyPatch()
    mp.setitem(REWARD_FUNCS, "short", short)
    cfg = RunConfig(run_dir=str(tmp_path_factory.mktemp("run") / "r"), iterations=2, num_prompts=2,
                    num_generations=3, reward_weights={"short": 1.0})
    cfg.model.name = str(save_tiny_phi(tmp_path_factory.mktemp("model"), tiny_tokenizer))
    cfg.lora.r = 4
    cfg.task.source, cfg.task.num_train = "chain_sum", 40
    cfg.rollout.max_new_tokens, cfg.rollout.max_turns, cfg.rollout.temperature = 12, 2, 0.7
    cfg.gate.val_size, cfg.gate.eval_every = 6, 1
    cfg.train.learning_rate, cfg.train.micro_batch_size = 1e-2, 4
    try:
        result = run(cfg.validate())
    finally:
        mp.undo()
    return result.run_dir


def test_overview_of_a_real_tiny_run(tiny_run, tmp_path):
    assert (tiny_run / "plots" / "overview.png").exists()  # the loop's own report has it
    assert main(["report", str(tiny_run), "--out", str(tmp_path)]) == 0
    assert "![overview](plots/overview.png)" in (tmp_path / "report.md").read_text()
    with Store(tiny_run / "selfrl.db", readonly=True) as s:
        marked = [m for m in (event_mark(e["kind"], e["message"]) for e in s.events()) if m is not None]
        tl = load_timeline(s, "tiny")
        fig = overview_figure([tl], "update")
        trajectories = s.count_trajectories()
    assert marked  # validated after both updates: each candidate was promoted, rejected or rolled back
    assert [h.at.update for h in tl.heldout][0] == 0 and all(h.n == 6 for h in tl.heldout)
    assert len(tl.heldout) >= 2 and tl.rollouts == trajectories == 12
    for ax in fig.axes:
        assert len(gids(ax, "event-line:")) == len(marked)
    assert all(len(gids(ax, "heldout-band")) == 1 for ax in fig.axes[:2])

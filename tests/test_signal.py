"""Signal-aware task choice and the no-signal diagnosis: pure parts by hand, then a tiny run."""

from __future__ import annotations

from selfrl.config import RunConfig
from selfrl.run.signal import PassRates, ProbeReport, SignalChooser, diagnose, probe_report, spread_probability
from selfrl.core.tasks import Task
from selfrl.core.trajectory import Trajectory


def _trajs(task_id: str, group: str, passes: list[bool]) -> list[Trajectory]:
    return [Trajectory(task_id, group, 0, reward=float(p), correct=p) for p in passes]


def test_spread_probability_and_pass_rate_posterior():
    assert spread_probability(0.5, 2) == 0.5 and spread_probability(0.25, 2) == 1 - 0.0625 - 0.5625
    rates = PassRates(prior_strength=2.0)
    assert rates.estimate("x") == 0.5  # nothing seen: the neutral prior
    rates.observe(_trajs("a", "g", [True] * 4) + _trajs("b", "h", [False] * 4))
    assert rates.overall() == 0.5
    assert rates.estimate("a") == (4 + 2 * 0.5) / (4 + 2) and rates.estimate("b") == 1 / 6
    assert rates.estimate("new") == 0.5


def test_chooser_skips_tasks_predicted_constant_and_retries_them_later():
    order = [Task.make("s", q, "1") for q in "abcdef"]
    ch = SignalChooser(group_size=8, min_spread=0.5, retry_after=2)
    assert [t.question for t in ch.choose(order, 0, 3)] == ["a", "b", "c"]
    # a: all failed twice, b: half right, c: all passed
    ch.observe(_trajs(order[0].id, "0", [False] * 16) + _trajs(order[1].id, "1", [True, False] * 4)
               + _trajs(order[2].id, "2", [True] * 16))
    assert ch.predicted_spread(order[0].id) < 0.5 < ch.predicted_spread(order[1].id)
    assert [t.question for t in ch.choose(order, 1, 3)] == ["d", "e", "f"]  # nothing skipped yet
    # walking on: a and c are skipped (predicted constant), b is kept
    assert [t.question for t in ch.choose(order, 2, 3)] == ["b", "d", "e"] and ch.last_skipped == 2
    # within retry_after they stay skipped even if nothing else is left
    picked = ch.choose(order, 3, 3)
    assert "a" not in [t.question for t in picked] and "c" not in [t.question for t in picked]


def test_probe_report_and_diagnosis_name_the_cause():
    all_fail = _trajs("a", "g1", [False] * 4) + _trajs("b", "g2", [False] * 4)
    report = probe_report(all_fail)
    assert (report.pass_at_1, report.pass_at_k, report.zero_signal, report.all_fail) == (0.0, 0.0, 1.0, 1.0)
    msg = diagnose(report, temperature=0.7, group_size=4, tools=True)
    assert msg.startswith("no signal: every group failed every sample")
    assert "tool use is 0%" in msg and "raise rollout.temperature (now 0.7)" in msg and "num_generations (now 4)" in msg
    assert "rollout.demonstration = true" in msg
    assert "more worked examples" in diagnose(report, 0.7, 4, True, demonstration=True)
    assert 'rollout.constrain = "tool_call"' in msg and 'tools_prompt = "compact"' in msg
    done = diagnose(report, 0.7, 4, True, True, tools_prompt="compact", constrain="tool_call")
    assert "tools_prompt" not in done and "can never answer" in done  # never a change already made
    assert "can never answer" not in msg
    easy = probe_report(_trajs("a", "g1", [True] * 4) + _trajs("b", "g2", [True] * 4))
    assert "too easy" in diagnose(easy, 1.0, 4, False)
    one_turn = Trajectory("a", "g1", 0, reward=0.0, correct=False,
                          messages=[{"role": "assistant", "content": '<tool_call>{"name": "f"}</tool_call>'}])
    assert probe_report([one_turn] + _trajs("a", "g1", [False])).tool_use == 0.5  # written, never dispatched
    mixed = probe_report(_trajs("a", "g1", [True, False]) + _trajs("b", "g2", [False, False]))
    assert mixed.zero_signal == 0.5 and diagnose(mixed, 1.0, 2, False) is None
    assert diagnose(ProbeReport(0, 0, 0, 0, 0, 1.0, 0, 0), 1.0, 2, False) == \
        "no signal: no scored group (every rollout failed)"
    failed = [Trajectory("t", "g", 0, error="the prompt is 1200 tokens; ... context of 1024 tokens"),
              Trajectory("t", "g", 0, error="later")]
    assert diagnose(probe_report(failed), 1.0, 2, False) == \
        "no signal: no scored group (every rollout failed: the first: the prompt is 1200 tokens; ... context of 1024 tokens)"


def _cfg(model_dir, run_dir, **task) -> RunConfig:
    cfg = RunConfig(run_dir=str(run_dir), iterations=2, num_prompts=2, num_generations=2)
    cfg.model.name = str(model_dir)
    cfg.lora.r = 4
    cfg.task.num_train = 10
    cfg.rollout.max_new_tokens = 6
    cfg.rollout.max_turns = 1
    cfg.gate.val_size = 2
    cfg.gate.eval_every = 10
    for k, v in task.items():
        setattr(cfg.task, k, v)
    return cfg.validate()


def test_a_run_without_signal_says_why_before_the_first_update_and_can_stop(model_dir, tmp_path):
    """A random tiny model never solves chain_sum: the pre-flight check says so and names fixes;
    with signal_check = "stop" the run ends before any update and the base is served."""
    from selfrl.run.main import run
    from selfrl.record.store import Store

    res = run(_cfg(model_dir, tmp_path / "stop", signal_check="stop"))
    assert res.stopped_early and res.final_version == 0
    with Store(tmp_path / "stop" / "selfrl.db") as store:
        events = store.events()
        steps = {m["step"] for m in store.metrics() if m["name"] == "reward/mean"}
    pre = [e["message"] for e in events if e["kind"] == "preflight"]
    assert len(pre) == 1 and "pass@1 0.00" in pre[0] and "no signal: every group failed every sample" in pre[0]
    assert steps == set()  # stopped before the first update was logged

    run(_cfg(model_dir, tmp_path / "warn", choice="signal"))  # warn: goes on, names the cause each iteration
    with Store(tmp_path / "warn" / "selfrl.db") as store:
        kinds = [e["kind"] for e in store.events()]
        names = {m["name"] for m in store.metrics()}
    assert kinds.count("preflight") == 1 and kinds.count("no_signal") == 2
    assert {"signal/pass_at_k", "signal/skipped_tasks", "frac_reward_zero_std"} <= names

"""``selfrl run`` with the judge reward, end to end: a tiny model's rollouts judged by a scripted
judge server on 127.0.0.1 (group mode, calibration pairs, a price), two iterations; the
verdicts, tokens and cost are recorded in the store and the report."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from judge_server import Reply, ScriptedJudge, candidates, solves, task_text, verdict_json

from selfrl.config import JudgeEndpoint, RunConfig
from selfrl.run.main import run
from selfrl.record.store import Store


def shorter_is_better(body: dict) -> Reply:
    """Known answers (``<answer>N</answer>``) graded by their value, the policy's by brevity."""
    task = task_text(body)
    scores = {}
    for cid, text in candidates(body).items():
        if re.fullmatch(r"\[assistant\] <answer>-?\d+</answer>", text):
            scores[cid] = solves(task, text)
        else:
            scores[cid] = max(0, 9 - len(text) // 8)
    return Reply(verdict_json(scores), usage=(400, 40))


def test_run_with_a_judge_records_verdicts_tokens_and_cost(model_dir, tmp_path):
    with ScriptedJudge(shorter_is_better) as server:
        cfg = RunConfig(run_dir=str(tmp_path / "run"), iterations=2, num_prompts=2, num_generations=3,
                        reward_weights={"judge": 1.0})
        cfg.model.name, cfg.model.device, cfg.engine = str(model_dir), "cpu", "reference"
        cfg.lora.r = 4
        cfg.task.num_train, cfg.task.signal_check = 40, "off"
        cfg.rollout.max_new_tokens, cfg.rollout.max_turns, cfg.rollout.temperature = 12, 2, 0.7
        cfg.gate.val_size, cfg.gate.eval_every = 4, 1
        cfg.train.learning_rate = 1e-2
        cfg.judge.endpoints = [JudgeEndpoint(name="scripted", base_url=server.url, model="judge-m",
                                             rubric="Shorter is better.", rubric_version="r1",
                                             price_input_per_m=1.0, price_output_per_m=4.0)]
        cfg.judge.calibration = "reference"
        cfg.detectors.names = ["judge_addressed", "judge_length_bias"]
        run(cfg.validate())
        requests = len(server.requests)
    assert requests == 4  # one call per group: 2 groups x 2 iterations (no distinct group repeats)
    with Store(tmp_path / "run" / "selfrl.db", readonly=True) as store:
        trajs = store.trajectories()
        metrics = {}
        for row in store.metrics():
            metrics.setdefault(row["name"], []).append(row["value"])
    assert len(trajs) == 12 and all(t.reward is not None for t in trajs)
    for t in trajs:
        rec = t.reward_details["judge"]["judges"]["scripted"]
        assert (rec["model"], rec["rubric_version"], rec["mode"]) == ("judge-m", "r1", "group")
        assert t.rewards["judge"] == rec["score"]
    assert metrics["judge/calls"] == [2.0, 2.0]
    assert metrics["judge/input_tokens"] == [800.0, 800.0]
    assert metrics["judge/cost"] == pytest.approx([2 * (400 * 1.0 + 40 * 4.0) / 1e6] * 2)
    assert metrics["judge/scripted/calibration"] == [1.0, 1.0]
    assert "hacking/judge_length_bias" in metrics
    report = (tmp_path / "run" / "report.md").read_text()
    assert "## Judge" in report and "| 1 | 0.00112 | 80 |" in report  # the judging that bought version 1
    rubrics = json.loads((tmp_path / "run" / "judge_rubrics.json").read_text())
    assert rubrics["scripted"]["rubric"] == "Shorter is better."
    assert (tmp_path / "run" / "judge_cache.db").exists()


def test_the_other_arms_differ_from_the_judge_config_only_in_the_reward_or_its_calibration():
    from selfrl.config import load_config

    configs = Path(__file__).resolve().parents[1] / "configs"
    judge, verifier = (load_config(configs / f"{name}.toml").to_dict() for name in ("judge", "judge_verifier"))
    assert (judge.pop("reward_weights"), verifier.pop("reward_weights")) == ({"judge": 1.0}, {"verifier": 1.0})
    uncalibrated = load_config(configs / "judge_uncalibrated.toml").to_dict()
    assert uncalibrated.pop("reward_weights") == {"judge": 1.0}
    judged = judge.pop("judge")
    assert judged["endpoints"] and not verifier.pop("judge")["endpoints"]
    assert (judged.pop("calibration"), uncalibrated["judge"].pop("calibration")) == ("reference", "off")
    assert uncalibrated.pop("judge") == judged
    assert judge == verifier == uncalibrated

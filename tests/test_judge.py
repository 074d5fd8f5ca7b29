"""The judge reward against a scripted judge server on 127.0.0.1: both modes, unreadable
verdicts, deadlines and retries, the cache, cost, ensembles and the floor, calibration."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from judge_server import Reply, ScriptedJudge, candidates, grade, solves, verdict_json

from selfrl.config import ConfigError, JudgeConfig, JudgeEndpoint, load_config
from selfrl.envs import get_env
from selfrl.judge import JUDGE
from selfrl.envs.rewards import score_group
from selfrl.rl.advantages import group_advantages
from selfrl.run.setup import check_names, reward_weights
from selfrl.core.trajectory import Trajectory

ENV = get_env("chain_sum")
TASK = ENV.sample(1, 0)[0]
RIGHT = TASK.answer.strip()
WEIGHTS = {"judge": 1.0}


def traj(answer: str, task=TASK, group: str = "g0") -> Trajectory:
    text = f"<answer>{answer}</answer>"
    return Trajectory(task.id, group, 0, messages=[
        {"role": "system", "content": "Give the final answer as <answer>NUMBER</answer>."},
        {"role": "user", "content": task.question}, {"role": "assistant", "content": text}],
        final_answer=text, completion_mask=[1] * 4, token_ids=[1] * 4, logprobs=[0.0] * 4)


def endpoint(url: str, **kw) -> JudgeEndpoint:
    e = JudgeEndpoint(name=kw.pop("name", "j"), base_url=url, rubric="The answer is the correct value.",
                      deadline_s=kw.pop("deadline_s", 5.0), retries=kw.pop("retries", 0), **kw)
    e.check()
    return e


def configure(*endpoints: JudgeEndpoint, run_dir=None, **kw) -> None:
    cfg = JudgeConfig(endpoints=list(endpoints), cache=kw.pop("cache", False), **kw)
    cfg.check()
    JUDGE.configure(cfg, run_dir)


@pytest.fixture(autouse=True)
def _close_judge():
    yield
    JUDGE.close()


def test_pointwise_scores_each_distinct_answer_once_and_records_the_judge():
    with ScriptedJudge(grade(solves)) as server:
        configure(endpoint(server.url, mode="pointwise", model="judge-m", rubric_version="v7"))
        group = [traj(RIGHT), traj("1"), traj(RIGHT)]
        score_group(group, TASK, ENV, WEIGHTS)
    assert [t.reward for t in group] == [1.0, 0.0, 1.0]
    assert len(server.requests) == 2  # the two equal answers are judged once
    body = server.requests[0]
    assert body["model"] == "judge-m" and body["temperature"] == 0.0
    assert body["response_format"]["type"] == "json_schema"
    assert body["response_format"]["json_schema"]["schema"]["properties"]["score"]["maximum"] == 10
    rec = group[1].reward_details["judge"]["judges"]["j"]
    assert (rec["model"], rec["rubric_version"], rec["mode"], rec["score"]) == ("judge-m", "v7", "pointwise", 0.0)
    assert len(rec["rubric_sha256"]) == 12 and rec["reason"] == "scripted"


def test_group_mode_is_one_call_with_the_task_shown_once():
    with ScriptedJudge(grade(solves, explain=False)) as server:
        configure(endpoint(server.url, mode="group", explain=False))
        group = [traj(RIGHT), traj("1"), traj("2"), traj(RIGHT)]
        score_group(group, TASK, ENV, WEIGHTS)
    assert [t.reward for t in group] == [1.0, 0.0, 0.0, 1.0]
    assert len(server.requests) == 1
    body = server.requests[0]
    user = next(m["content"] for m in body["messages"] if m["role"] == "user")
    assert user.count(TASK.question) == 1  # the shared context once
    assert sorted(candidates(body)) == ["c1", "c2", "c3"]  # three distinct answers
    assert sorted(body["response_format"]["json_schema"]["schema"]["required"]) == ["c1", "c2", "c3"]


def test_unreadable_verdict_is_a_recorded_failure_left_out_of_the_update():
    with ScriptedJudge(lambda body: Reply("Score: 9/10, a fine answer")) as server:
        configure(endpoint(server.url, mode="pointwise", retries=1))
        group = [traj(RIGHT), traj("1")]
        score_group(group, TASK, ENV, WEIGHTS)
    assert len(server.requests) == 4  # two answers, each tried twice
    for t in group:
        assert t.reward is None and "unreadable verdict" in t.error and "JudgeFailure" in t.error
        assert t.reward_details["judge"]["judges"]["j"]["score"] is None
    adv = group_advantages([t.reward for t in group], [t.group_id for t in group], "group")
    assert adv.advantages == [None, None]  # left out, never a 0
    m = JUDGE.pop_metrics()
    assert (m["judge/failed"], m["judge/scored"], m["judge/failed_calls"]) == (2.0, 0.0, 2.0)


def test_a_verdict_cut_at_max_tokens_says_what_to_change():
    with ScriptedJudge(lambda body: Reply('{"c1": {"reason": "fine", "sc', finish_reason="length")) as server:
        configure(endpoint(server.url, mode="group", max_tokens=12))
        group = [traj(RIGHT), traj("1")]
        score_group(group, TASK, ENV, WEIGHTS)
    assert all(t.reward is None and "cut at max_tokens = 12; raise max_tokens" in t.error for t in group)


def test_a_verdict_out_of_range_or_missing_an_id_is_unreadable():
    with ScriptedJudge(lambda body: Reply(json.dumps({"c1": {"reason": "x", "score": 11}}))) as server:
        configure(endpoint(server.url, mode="group"))
        group = [traj(RIGHT), traj("1")]
        score_group(group, TASK, ENV, WEIGHTS)
    assert all(t.reward is None and "candidate ids missing ['c2']" in t.error for t in group)


def test_deadline_then_a_retry_that_answers():
    calls = []

    def slow_first(body):
        calls.append(1)
        return Reply(verdict_json(7), delay_s=2.0 if len(calls) == 1 else 0.0)

    with ScriptedJudge(slow_first) as server:
        configure(endpoint(server.url, mode="pointwise", deadline_s=0.5, retries=1))
        group = [traj(RIGHT)]
        score_group(group, TASK, ENV, WEIGHTS)
        m = JUDGE.pop_metrics()
    assert group[0].reward == 0.7
    assert (m["judge/timeouts"], m["judge/calls"], m["judge/failed_calls"]) == (1.0, 1.0, 0.0)


def test_deadline_on_every_try_is_a_failure():
    with ScriptedJudge(lambda body: Reply(verdict_json(7), delay_s=2.0)) as server:
        configure(endpoint(server.url, mode="pointwise", deadline_s=0.3, retries=1))
        group = [traj(RIGHT)]
        score_group(group, TASK, ENV, WEIGHTS)
    assert group[0].reward is None
    assert "no answer within deadline_s = 0.3 s" in group[0].error and "after 2 tries" in group[0].error


def test_an_endpoint_without_structured_output_is_parsed_strictly():
    def no_schema(body):
        if "response_format" in body:
            return Reply("response_format is not supported", status=400)
        return Reply("```json\n" + verdict_json(9) + "\n```")

    with ScriptedJudge(no_schema) as server:
        configure(endpoint(server.url, mode="pointwise", max_concurrency=1))
        group = [traj(RIGHT), traj("3")]
        score_group(group, TASK, ENV, WEIGHTS)
    assert [t.reward for t in group] == [0.9, 0.9]
    assert ["response_format" in b for b in server.requests] == [True, False, False]  # asked once, then never


def test_a_refusal_is_not_retried_and_says_why():
    with ScriptedJudge(lambda body: Reply("invalid api key", status=401)) as server:
        configure(endpoint(server.url, mode="pointwise", retries=3))
        group = [traj(RIGHT)]
        score_group(group, TASK, ENV, WEIGHTS)
    assert len(server.requests) == 1
    assert "refused the request (HTTP 401): invalid api key" in group[0].error


def test_cache_hit_makes_no_second_request_and_survives_a_restart(tmp_path):
    with ScriptedJudge(grade(solves)) as server:
        for mode in ("pointwise", "group"):
            server.requests.clear()
            configure(endpoint(server.url, mode=mode), run_dir=tmp_path / mode, cache=True)
            score_group([traj(RIGHT), traj("5")], TASK, ENV, WEIGHTS)
            first = len(server.requests)
            JUDGE.pop_metrics()
            again = [traj(RIGHT), traj("5")]  # new trajectories, same content
            score_group(again, TASK, ENV, WEIGHTS)
            assert len(server.requests) == first and [t.reward for t in again] == [1.0, 0.0]
            assert JUDGE.pop_metrics()["judge/cache_hits"] == 2.0
            configure(endpoint(server.url, mode=mode), run_dir=tmp_path / mode, cache=True)  # a resumed run
            score_group([traj(RIGHT), traj("5")], TASK, ENV, WEIGHTS)
            assert len(server.requests) == first
        # another rubric version is another key
        configure(endpoint(server.url, mode="group", rubric_version="2"), run_dir=tmp_path / "group", cache=True)
        score_group([traj(RIGHT), traj("5")], TASK, ENV, WEIGHTS)
        assert len(server.requests) == first + 1


def test_tokens_and_cost_are_counted():
    with ScriptedJudge(lambda body: Reply(verdict_json(5), usage=(1000, 50))) as server:
        configure(endpoint(server.url, mode="pointwise", price_input_per_m=2.0, price_output_per_m=8.0))
        score_group([traj("1"), traj("2"), traj("3")], TASK, ENV, WEIGHTS)
        m = JUDGE.pop_metrics()
    assert (m["judge/calls"], m["judge/input_tokens"], m["judge/output_tokens"]) == (3.0, 3000.0, 150.0)
    assert m["judge/cost"] == pytest.approx(3 * (1000 * 2.0 + 50 * 8.0) / 1e6)
    assert m["judge/j/cost"] == m["judge/cost"]
    assert JUDGE.pop_metrics()["judge/calls"] == 0.0  # popped


def test_no_price_logs_tokens_but_no_cost():
    with ScriptedJudge(lambda body: Reply(verdict_json(5), usage=None)) as server:
        configure(endpoint(server.url, mode="pointwise"))
        score_group([traj("1")], TASK, ENV, WEIGHTS)
        m = JUDGE.pop_metrics()
    assert "judge/cost" not in m and m["judge/input_tokens"] == 0.0


def test_api_key_comes_from_the_named_variable(monkeypatch):
    with ScriptedJudge(lambda body: Reply(verdict_json(5))) as server:
        e = endpoint(server.url, mode="pointwise", api_key_env="SELFRL_TEST_JUDGE_KEY")
        monkeypatch.delenv("SELFRL_TEST_JUDGE_KEY", raising=False)
        with pytest.raises(ValueError, match="SELFRL_TEST_JUDGE_KEY .* is not set"):
            configure(e)
        monkeypatch.setenv("SELFRL_TEST_JUDGE_KEY", "sk-test")
        configure(e)
        score_group([traj("1")], TASK, ENV, WEIGHTS)
    assert server.requests[0]["_authorization"] == "Bearer sk-test"


def two_judges(lenient, strict, **kw):
    configure(endpoint(lenient.url, name="lenient", mode="pointwise"),
              endpoint(strict.url, name="strict", mode="pointwise"), **kw)


def test_ensemble_min_mean_and_vote():
    with ScriptedJudge(lambda b: Reply(verdict_json(9))) as lenient, \
            ScriptedJudge(lambda b: Reply(verdict_json(6))) as strict:
        for rule, want in (("min", 0.6), ("mean", 0.75), ("vote", 1.0)):
            two_judges(lenient, strict, combine=rule, disagreement=0.5)
            group = [traj("1")]
            score_group(group, TASK, ENV, WEIGHTS)
            assert group[0].reward == pytest.approx(want), rule
        two_judges(lenient, strict, combine="vote", vote_threshold=0.7)
        group = [traj("1")]
        score_group(group, TASK, ENV, WEIGHTS)
        assert group[0].reward == 0.5


def test_disagreement_holds_the_group_out_or_is_recorded():
    with ScriptedJudge(lambda b: Reply(verdict_json(9))) as lenient, \
            ScriptedJudge(lambda b: Reply(verdict_json(1) if "<answer>1</answer>" in b["messages"][1]["content"]
                                          else verdict_json(8))) as strict:
        two_judges(lenient, strict, combine="min", disagreement=0.5)
        group = [traj("1"), traj("2")]
        score_group(group, TASK, ENV, WEIGHTS)
        assert all(t.reward is None and "judges disagree on 1 of 2" in t.error for t in group)
        assert group[0].reward_details["judge"]["disputed"] is True
        m = JUDGE.pop_metrics()
        assert (m["judge/disputed"], m["judge/held_out_groups"]) == (1.0, 1.0)
        two_judges(lenient, strict, combine="min", disagreement=0.5, hold_out_disputed=False)
        group = [traj("1"), traj("2")]
        score_group(group, TASK, ENV, WEIGHTS)
        assert [t.reward for t in group] == [pytest.approx(0.1), pytest.approx(0.8)]
        assert JUDGE.pop_metrics()["judge/disputed"] == 1.0


def test_rule_members_and_the_floor():
    with ScriptedJudge(lambda b: Reply(verdict_json(10))) as fooled:
        configure(endpoint(fooled.url, mode="pointwise"), floor="verifier")
        group = [traj(RIGHT), traj("1")]
        score_group(group, TASK, ENV, WEIGHTS)
        assert [t.reward for t in group] == [1.0, 0.0]  # the failed check caps the judge's 1.0
        assert group[1].reward_details["judge"]["floor"] == {"verifier": 0.0}
        configure(endpoint(fooled.url, mode="pointwise"), rules=["verifier"], combine="mean", disagreement=1.0)
        group = [traj(RIGHT), traj("1")]
        score_group(group, TASK, ENV, WEIGHTS)
        assert [t.reward for t in group] == [1.0, 0.5]


def test_calibration_failure_holds_the_batch_back():
    def prefers_wrong(body):  # scores the known-bad answer above the known-good one
        return grade(lambda task, a: 10 - solves(task, a))(body)

    for mode in ("group", "pointwise"):
        with ScriptedJudge(prefers_wrong) as server:
            configure(endpoint(server.url, mode=mode), calibration="reference")
            group = [traj(RIGHT), traj("1")]
            score_group(group, TASK, ENV, WEIGHTS)
        assert all(t.reward is None and "failed calibration: ranked 1 of 1" in t.error for t in group), mode
        m = JUDGE.pop_metrics()
        assert (m["judge/j/calibration"], m["judge/held_out_groups"]) == (0.0, 1.0)
        if mode == "group":  # the known answers were mixed into the group's own call, unlabelled
            assert len(server.requests) == 1 and len(candidates(server.requests[0])) == 4
        else:
            assert len(server.requests) == 4


def test_calibration_passes_a_competent_judge_and_tracks_agreement(tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"question": "State the final answer to the following arithmetic problem: 2 + 2 =",
                                 "good": "<answer>4</answer>", "bad": "<answer>5</answer>"}) + "\n")
    for spec in ("reference", str(pairs)):
        with ScriptedJudge(grade(solves)) as server:
            configure(endpoint(server.url, mode="group"), calibration=spec, calibration_pairs=2)
            group = [traj(RIGHT), traj("1")]
            score_group(group, TASK, ENV, WEIGHTS)
        assert [t.reward for t in group] == [1.0, 0.0], spec
        assert JUDGE.pop_metrics()["judge/j/calibration"] == 1.0


def test_a_tie_on_a_known_pair_is_wrong_and_errors_up_to_the_limit_pass():
    with ScriptedJudge(lambda b: grade(lambda t, a: 5)(b)) as server:
        configure(endpoint(server.url, mode="pointwise"), calibration="reference", calibration_pairs=2,
                  calibration_max_errors=0.5)
        group = [traj(RIGHT)]
        score_group(group, TASK, ENV, WEIGHTS)
        assert group[0].reward is None and "ranked 2 of 2" in group[0].error


def test_unconfigured_judge_is_a_recorded_failure():
    JUDGE.close()
    group = [traj(RIGHT)]
    score_group(group, TASK, ENV, WEIGHTS)
    assert group[0].reward is None and "has no judge" in group[0].error


def test_judge_failure_is_never_zero_in_the_reward_breakdown():
    with ScriptedJudge(lambda b: Reply("no", status=500)) as server:
        configure(endpoint(server.url, mode="group"))
        group = [traj(RIGHT), traj("1")]
        score_group(group, TASK, ENV, WEIGHTS)
    assert all(t.reward is None and "HTTP 500" in t.error for t in group)
    assert all(t.rewards.get("judge") is None for t in group)


# ---------------------------------------------------------------- configuration


def judge_toml(tmp_path, extra: str = "", weights: str = "reward_weights = { judge = 1.0 }") -> str:
    path = tmp_path / "c.toml"
    path.write_text(f"""{weights}
[judge]
{extra}
[[judge.endpoints]]
name = "smol"
base_url = "http://127.0.0.1:9/v1"
rubric = "Correct final number."
""")
    return str(path)


def test_the_shipped_judge_config_loads():
    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "judge.toml")
    assert reward_weights(cfg) == {"judge": 1.0} and cfg.judge.endpoints[0].mode == "group"
    assert cfg.judge.calibration == "reference"


def test_config_reads_the_judge_section(tmp_path):
    cfg = load_config(judge_toml(tmp_path, 'combine = "min"\nfloor = "verifier"'))
    assert cfg.judge.names == ["smol"] and cfg.judge.combine == "min" and cfg.judge.endpoints[0].mode == "group"


@pytest.mark.parametrize("extra, message", [
    ('combine = "median"', "judge.combine must be one of 'mean', 'min', 'vote'"),
    ('floor = "nope"', "unknown reward function 'nope'"),
    ('rules = ["judge"]', "cannot be one of its own rules"),
    ('calibration = "missing.jsonl"', "calibration must be 'off', 'reference' or a JSONL file"),
    ("calibration_max_errors = 1.0", "calibration_max_errors must be in [0, 1)"),
])
def test_config_refuses_bad_judge_values(tmp_path, extra, message):
    with pytest.raises(ConfigError, match=re.escape(message)):  # a value when it loads, a name at setup
        check_names(load_config(judge_toml(tmp_path, extra)))


@pytest.mark.parametrize("field, value, message", [
    ("mode", "listwise", "mode must be one of 'pointwise', 'group'"),
    ("deadline_s", 0.0, "deadline_s must be > 0"),
    ("max_concurrency", 0, "max_concurrency must be >= 1"),
    ("api_key_env", "sk-live-123", "api_key_env must be an environment variable NAME"),
    ("base_url", "127.0.0.1:8200", "base_url must start with http://"),
    ("price_input_per_m", -1.0, "price_input_per_m must be >= 0"),
])
def test_config_refuses_bad_endpoint_values(tmp_path, field, value, message):
    with pytest.raises(ConfigError, match=f"judge.endpoints\\[0\\] \\(smol\\).{message}"):
        load_config(judge_toml(tmp_path), {f"judge.endpoints": [{"name": "smol", "base_url": "http://x", "rubric": "r",
                                                                   field: value}]})


def test_a_judge_without_its_reward_and_the_reward_without_a_judge_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="no reward weights 'judge'"):
        check_names(load_config(judge_toml(tmp_path, weights="")))
    with pytest.raises(ConfigError, match="the reward 'judge' needs a judge"):
        check_names(load_config(None, {"reward_weights": {"judge": 1.0}}))


def test_config_checks_judge_names_without_importing_the_judge(tmp_path):
    code = (f"import sys; from selfrl.config import load_config; from selfrl.run.setup import check_names; "
            f"check_names(load_config({judge_toml(tmp_path)!r}, "
            "{'detectors.names': ['judge_vacuous', 'judge_length_bias']})); "
            "print('selfrl.judge' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_an_unexpected_error_in_a_call_is_recorded_and_the_group_judged_once():
    from selfrl.judge.client import JudgeClient

    class Broken(JudgeClient):
        calls = 0

        def complete(self, messages, schema, parse):
            Broken.calls += 1
            raise RuntimeError("socket exploded")

    e = endpoint("http://127.0.0.1:9/v1", mode="group")
    JUDGE.configure(JudgeConfig(endpoints=[e], cache=False), clients={"j": Broken(e)})
    group = [traj(RIGHT), traj("1"), traj("2")]
    score_group(group, TASK, ENV, WEIGHTS)
    assert Broken.calls == 1
    assert all(t.reward is None and "RuntimeError: socket exploded" in t.error for t in group)


def test_concurrent_calls_refused_structured_output_are_all_asked_again():
    def no_schema(body):  # the refusals come late, so every first try is in flight before one returns
        if "response_format" in body:
            return Reply("response_format is not supported", status=400, delay_s=0.3)
        return Reply(verdict_json(9))

    with ScriptedJudge(no_schema) as server:
        configure(endpoint(server.url, mode="pointwise", max_concurrency=4))
        group = [traj(str(n)) for n in range(4)]
        score_group(group, TASK, ENV, WEIGHTS)
    assert [t.reward for t in group] == [0.9] * 4

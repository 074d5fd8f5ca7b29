"""``scripts/judge_agreement.py``: rollouts of an environment with a hidden verifier, judged by an
endpoint (here a scripted judge server), scored against the verifier: arithmetic and function calling."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
from judge_server import ScriptedJudge, grade, solves

from selfrl.envs import get_env
from selfrl.envs.function_calling import _first
from selfrl.rollout.agent import RolloutConfig, scripted_rollout

ROOT = Path(__file__).resolve().parent.parent
FC_CONFIG = str(ROOT / "configs" / "function_calling.toml")


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("judge_agreement", ROOT / "scripts" / "judge_agreement.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(out: str) -> list[str]:
    """The cells of the printed markdown row (the third line)."""
    return [c.strip() for c in out.strip().splitlines()[2].strip("|").split("|")]


def _write(trajs, path: Path) -> None:
    path.write_text("".join(t.to_json() + "\n" for t in trajs))


def values_in_request(task: str, answer: str) -> int:
    """A shallow function-calling judge: 10 when the answer calls a function listed in the task's
    tools with every argument value written in the user's request, else 0 (so it is fooled by
    the request's values put under the wrong parameters)."""
    call = re.search(r"<tool_call>(.*?)</tool_call>", answer, re.DOTALL)
    request = task.rsplit("[user] ", 1)[-1]
    if call is None:
        return 0
    c = json.loads(call.group(1))
    offered = f"- {c['name']}(" in task
    return 10 if offered and all(str(v) in request for v in c["arguments"].values()) else 0


def test_function_calling_calls_are_judged_without_the_reference(script, tmp_path, capsys):
    env = get_env("function_calling", categories=["simple"], max_params=3)
    tasks = env.sample(2, 0)
    cfg = RolloutConfig(max_turns=1, tools=[], stop_at_tool_call=True)
    trajs = []
    for i, task in enumerate(tasks):
        (name, expected), = task.metadata["ground_truth"][0].items()
        right = {p: _first(v[0]) for p, v in expected.items() if v and v[0] != ""}
        keys = list(right)
        unknown = {**right, keys[0]: 987654}  # a value the request never states
        swapped = dict(zip(keys, [right[k] for k in keys[1:] + keys[:1]]))  # the request's values, misplaced
        for args in (right, right, unknown, swapped):
            text = "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"
            trajs += scripted_rollout(lambda t, m, x=text: x, [task], [], cfg, env.make_env, group_ids=[f"g{i}"])
    rollouts = tmp_path / "fc.jsonl"
    _write(trajs, rollouts)
    with ScriptedJudge(grade(values_in_request, explain=False)) as judge:
        script.main(["judge", "--config", FC_CONFIG, "--rollouts", str(rollouts), "--base-url", judge.url,
                     "--tasks", "2", "--generations", "4", "--mode", "group"])
    row = _row(capsys.readouterr().out)
    # judged, failed, right; AUC: each right call (10) beats the unknown value (0), ties the swap (10)
    assert row[1] == "function_calling" and row[10] == "1.00 / 0.50"
    assert row[4:10] == ["8", "0", "4", "0.750", "0.750 (8)", "0.577 (2)"]
    assert len(judge.requests) == 2  # one call per group, its three distinct answers
    for body, task in zip(judge.requests, tasks):
        system, user = (m["content"] for m in body["messages"])
        assert script.FUNCTION_CALLING_RUBRIC in system
        fn = task.metadata["functions"][0]
        assert f"- {fn['name']}(" in user and all(p in user for p in fn["parameters"]["properties"])
        assert task.question in user and "get_weather" not in user  # the request; not the worked example
        assert task.answer not in user and "ground_truth" not in user  # never the reference


def test_the_default_environment_is_still_arithmetic(script, tmp_path, capsys):
    env = get_env("chain_sum")
    [task] = env.sample(1, 0)
    value = int(task.answer)
    trajs = []
    for v in (value, value, value + 1):
        trajs += scripted_rollout(lambda t, m, x=v: f"<answer>{x}</answer>", [task], [], RolloutConfig(),
                                  group_ids=["g0"])
    _write(trajs, tmp_path / "a.jsonl")
    with ScriptedJudge(grade(solves, explain=False)) as judge:
        script.main(["judge", "--rollouts", str(tmp_path / "a.jsonl"), "--base-url", judge.url, "--tasks", "1",
                     "--mode", "pointwise"])
    assert _row(capsys.readouterr().out)[1:9] == ["chain_sum", "pointwise", "no", "3", "0", "2", "1.000", "1.000 (2)"]
    assert script.ARITHMETIC_RUBRIC in judge.requests[0]["messages"][0]["content"]


def test_an_unknown_environment_or_one_without_a_rubric_is_refused(script):
    with pytest.raises(SystemExit, match=r"unknown environment 'nope'; valid names: .*function_calling"):
        script.main(["sample", "--env", "nope", "--out", "/dev/null"])
    with pytest.raises(SystemExit, match="no rubric for environment 'webshop'.*pass --rubric"):
        script.main(["judge", "--env", "webshop", "--rollouts", "/dev/null", "--base-url", "http://127.0.0.1:9/v1"])


def test_function_calling_rollouts_are_sampled_under_the_configs_grammar(script, model_dir, tmp_path, capsys):
    out = tmp_path / "fc.jsonl"
    script.main(["sample", "--config", FC_CONFIG, "--model", str(model_dir), "--tasks", "1", "--generations", "2",
                 "--out", str(out)])
    assert re.match(r"2 rollouts of .* on 1 function_calling tasks \(seed 0\) in \d+ s; verifier: \d+ right",
                    capsys.readouterr().out)
    env = get_env("function_calling", categories=["simple"], max_params=3)
    [task] = env.sample(1, 0)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [d["task_id"] for d in lines] == [task.id, task.id]
    name = task.metadata["functions"][0]["name"]
    for d in lines:  # one turn (max_turns = 1), and the grammar made even a random tiny model call the function
        turns = [m["content"] for m in d["messages"][-1:] if m["role"] == "assistant"]
        assert d["messages"][-2]["content"] == task.question and len(turns) == 1
        assert turns[0].startswith('<tool_call>{"name":"' + name + '","arguments":{"'), turns[0]

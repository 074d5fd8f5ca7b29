"""The multiple-choice tier of repository repair (``tier = "choice"``): the buggy line is named
and the fixed line is one of k candidates, the fix, the bug and other one-node mutants of the
clean line; the grammar enforces the choice; the reward is the real tests on a clean copy."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from selfrl.config import RolloutConfig
from selfrl.engines.reference import Engine
from selfrl.envs import get_env
from selfrl.envs.swe import hacking_policy, honest_policy
from selfrl.envs.swe_easy import CHOICE_DEMONSTRATION, choice_options, choice_view, easy_view
from selfrl.envs.swe_tasks import Instance
from selfrl.rollout.agent import rollout, scripted_rollout
from selfrl.chat.toolcall import parse_tool_calls
from selfrl.core.tools import ToolError, validate_arguments

FILL = "minitext__format-14"  # pad_center returns fill * left + text - fill * right


@pytest.fixture(scope="module")
def choice():
    return get_env("swe", tier="choice")


def _task(env, instance_id):
    return next(t for t in env._ordered() if t.metadata["instance_id"] == instance_id)


CLEAN = "def clamp(x, lo, hi):\n    if x < lo:\n        return lo\n    return min(x, hi)\n\n\ndef span(a, b):\n" \
        "    return b - a + 1\n"


def _hand_built(tmp_path) -> Instance:
    """A one-module repository whose ``span`` has ``b + a`` for ``b - a`` on line 8."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(CLEAN)
    buggy = CLEAN.replace("b - a + 1", "b + a + 1")
    return Instance("hand__m-0", str(tmp_path), "span(1, 3) != 3", ["tests/test_m.py::test_span"], [],
                    {"pkg/m.py": buggy}, "swap_operator",
                    {"path": "pkg/m.py", "old": "return b + a + 1", "new": "return b - a + 1"})


def test_candidates_are_the_fix_the_bug_and_the_clean_lines_other_one_node_mutants(tmp_path):
    """``return b - a + 1`` has three mutation sites: the inner ``-`` (swapped: the bug), the
    outer ``+`` (swapped: ``b - a - 1``) and the literal 1 (off by one: ``b - a + 2``)."""
    inst = _hand_built(tmp_path)
    view = easy_view(inst, named=True)
    assert view.bug_line == 8 and view.choices == ("return b + a + 1",)
    four = choice_options(inst, view, 4)
    assert sorted(four) == ["return b + a + 1", "return b - a + 1", "return b - a + 2", "return b - a - 1"]
    assert choice_options(inst, view, 4) == four  # the shuffle is seeded by the instance id
    three = choice_options(inst, view, 3)
    assert len(three) == 3 and {"return b + a + 1", "return b - a + 1"} <= set(three) <= set(four)
    assert sorted(choice_options(inst, view, 2)) == ["return b + a + 1", "return b - a + 1"]
    assert sorted(choice_options(inst, view, 9)) == sorted(four)  # fewer than k: what there is
    assert choice_view(inst, view, 4).options == four
    known = {"return b + a + 1", "return b - a - 1"}  # the mutants known to fail a test: b - a + 2 is left out
    assert sorted(choice_options(inst, view, 4, known)) == ["return b + a + 1", "return b - a + 1", "return b - a - 1"]
    with pytest.raises(ValueError, match="choices must be >= 2"):
        choice_options(inst, view, 1)


def test_choice_tier_lists_the_candidates_and_its_schema_allows_only_them(choice):
    task = _task(choice, FILL)
    view = choice.views[FILL]
    assert view.options == ("return fill * left + text - fill * right", "return fill * left + text + fill * right",
                            "return fill * left - text + fill * right", "return fill * left + text + fill / right")
    assert task.question.endswith(
        "  48      return fill * left + text - fill * right\n"
        "The bug is on line 48. Fix it with one edit: old is that line, new is the fixed line, one of these 4:\n"
        "1. return fill * left + text - fill * right\n2. return fill * left + text + fill * right\n"
        "3. return fill * left - text + fill * right\n4. return fill * left + text + fill / right\n"
        "Pick the one that makes the failing tests pass.")
    st = choice.make_env(task)
    [edit] = st.tools
    assert st.demonstration is CHOICE_DEMONSTRATION
    assert edit.parameters["properties"] == {
        "path": {"type": "string", "enum": ["minitext/format.py"]},
        "old": {"type": "string", "enum": ["return fill * left + text - fill * right"]},
        "new": {"type": "string", "enum": list(view.options)}}
    with pytest.raises(ToolError, match="argument 'new' of 'edit' must be one of"):  # checked without a grammar too
        validate_arguments(edit, {"path": view.path, "old": view.fix["old"], "new": "return text.center(width, fill)"})


def test_the_real_tests_pay_the_fix_and_not_a_distractor(choice):
    """Through the env's own path: the tool edits the trajectory's copy, the answer is its
    changes, and the scoring run on a clean copy decides."""
    task = _task(choice, FILL)
    view = choice.views[FILL]
    paid = {}
    for new in (view.options[1], view.options[2], view.options[0]):  # the fix, a mutant, the bug (a no-op)
        st = choice.make_env(task)
        st.edit(view.path, view.fix["old"], new)
        assert st.is_completed()
        paid[new] = choice.score(task, json.dumps(st.state()["changes"]))
    assert view.fix["new"] == view.options[1]
    assert paid == {view.options[1]: 1.0, view.options[2]: 0.0, view.options[0]: 0.0}
    [honest] = scripted_rollout(honest_policy(choice), [task], [], RolloutConfig(max_turns=2),
                                env_factory=choice.make_env)
    assert choice.score(task, choice.trajectory_answer(honest)) == 1.0
    [hack] = scripted_rollout(hacking_policy(choice, "hardcode"), [task], [], RolloutConfig(max_turns=2),
                              env_factory=choice.make_env)
    assert hack.env_state == {"changes": {}} and not hack.tool_calls[0].ok  # special cases are not a candidate


def test_choice_tier_instances_spread_the_fix_over_positions_and_split_disjoint_by_statement(choice):
    """116 instances (the line tier's), none skipped: 69 with 4 candidates, 28 with 3, 19 with 2;
    every candidate but the fix is a generated bug of that line (so the tests fail it); the fix
    sits at every position, none holding more than a third of the 4-candidate ones."""
    assert len(choice.instances) == 116 and choice.skipped == 0
    views = list(choice.views.values())
    assert Counter(len(v.options) for v in views) == {4: 69, 3: 28, 2: 19}
    bugs = {(v.path, v.bug_line, v.fix["old"]) for v in views}
    assert all((v.path, v.bug_line, o) in bugs for v in views for o in v.options if o != v.fix["new"])
    assert all(v.fix["new"] in v.options and v.fix["old"] in v.options and len(set(v.options)) == len(v.options)
               for v in views)
    where = Counter(v.options.index(v.fix["new"]) for v in views if len(v.options) == 4)
    assert set(where) == {0, 1, 2, 3} and max(where.values()) <= 69 // 3, where
    train, val = choice.split(80, 32, 0, 1)
    statement = {t.id: choice.instance(t).problem_statement for t in train + val}
    assert len(val) == 32 and not {t.id for t in train} & {t.id for t in val}
    assert not {statement[t.id] for t in train} & {statement[t.id] for t in val}
    two = get_env("swe", tier="choice", choices=2)
    assert {len(v.options) for v in two.views.values()} == {2} and len(two.instances) == 116
    with pytest.raises(ValueError, match="choices must be >= 2"):
        get_env("swe", tier="choice", choices=1)
    with pytest.raises(ValueError, match='choices = 3 is an option of tier = "choice", not of tier = \'line\''):
        get_env("swe", tier="line", choices=3)


def test_choice_tier_shots_are_solved_instances_with_their_candidates():
    env = get_env("swe", tier="choice", shots=1)
    user, call, _ = env.demonstration
    assert len(env.instances) == 115 and "Pick the one that makes the failing tests pass." in user["content"]
    args = json.loads(call["content"][len("<tool_call>"):-len("</tool_call>")])["arguments"]
    shown = [line.split(". ", 1)[1] for line in user["content"].splitlines() if line[:1].isdigit() and ". " in line[:4]]
    assert args["new"] in shown and args["new"] != args["old"]


def test_constrained_choice_rollout_picks_one_of_the_candidates(choice, tiny_tokenizer, tiny_model):
    """A random tiny model under the tier's grammar: every finished call edits the named line
    into one of the candidates."""
    task = _task(choice, FILL)
    cfg = RolloutConfig(max_turns=2, max_new_tokens=256, temperature=1.0, tools=[], constrain="tool_call")
    torch.manual_seed(0)
    trajs = rollout(Engine(tiny_model, tiny_tokenizer), [task] * 4, ["g"] * 4, [], cfg, env_factory=choice.make_env)
    view = choice.views[FILL]
    done = [t for t in trajs if not t.truncated]
    assert len(done) >= 2, [t.messages[-1] for t in trajs]
    for t in done:
        _, [call] = parse_tool_calls(t.messages[-2]["content"])
        assert call.arguments["old"] == view.fix["old"] and call.arguments["new"] in view.options
        after = t.env_state["changes"].get(view.path, {}).get("after")
        assert after is None if call.arguments["new"] == view.fix["old"] else call.arguments["new"] in after


def test_swe_choice_config_is_the_choice_tier_under_the_grammar_paying_the_verifier_alone():
    from selfrl.envs import load_run_config

    cfg = load_run_config("configs/swe_choice.toml", {})
    assert cfg.task.options == {"tier": "choice", "choices": 4} and cfg.rollout.constrain == "tool_call"
    assert cfg.preset == "swe" and cfg.engine == "slots" and cfg.gate.val_size == 32


@pytest.mark.parametrize("options, message", [
    ({"tier": "choice", "choices": "4"}, "choices must be an integer, got '4'"),
    ({"tier": "choice", "choices": 2.5}, "choices must be an integer, got 2.5"),
    ({"tier": "choice", "choices": True}, "choices must be an integer, got True"),
    ({"tier": "easy", "shots": "2"}, "shots must be an integer, got '2'"),
    ({"tier": "choice", "choise": 4}, "environment 'swe' has no option 'choise'; valid: .*choices"),
])
def test_an_option_of_the_wrong_type_or_name_is_a_clear_error(options, message):
    from selfrl.envs import get_env

    with pytest.raises(ValueError, match=message):
        get_env("swe", **options)

"""The function-calling environment: BFCL questions, the task's functions as tools, AST match.

Task source: BFCL v4 from the ``bfcl-eval`` wheel, the categories ``simple``
(simple_python, 400), ``multiple`` (200), ``parallel`` (200),
``parallel_multiple`` (200) and ``irrelevance`` (240: none of the functions
fits, the right answer is no call). ``[task] options.categories`` picks the mix
(default: all five, 1,240 tasks); it may also name the live categories
(``LIVE_CATEGORIES``, user-contributed questions): ``live_simple`` (258),
``live_multiple`` (1,053), ``live_parallel`` (16), ``live_parallel_multiple`` (24),
``live_irrelevance`` (871 of 884) and ``live_relevance`` (16: some function fits; any call
is right, as bfcl-eval scores it). A live question's system message is put before its
user message in the task's question (the run's ``rollout.system_prompt`` stays the system
prompt). Left out, and counted in ``left_out``: a question that is a conversation (an
earlier assistant turn; 9 of live_irrelevance: a task here is one request) and one that
offers no function (4 of live_irrelevance: a grammar-constrained turn needs a tool).
Split: per category, a fixed order by content hash of the BFCL id; the held-out set takes
``n_val`` tasks spread over the categories in proportion to their size, training takes the rest.

Tools: the task's function schemas (``selfrl.envs.bfcl.to_openai_tools``), bound to a
per-trajectory state that records the calls; the episode ends after the first
turn that made a call. Verifier: BFCL's AST match (``selfrl.envs.bfcl.ast_match``,
equal to bfcl-eval's own checker); ``correct`` is the exact match only. ``score``
gives partial credit below it (``partial_score``: 0.5 for the right function
names, 0.5 x the share of right argument values, at most 0.9), for the
``function_calling-partial`` preset. live_relevance has no right values, so no partial credit (1.0 for a call, else 0.0).
The answer is the calls as canonical JSON;
``agreement_scores`` is ``selfrl.envs.bfcl.call_agreement`` (label-free).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from typing import Any, ClassVar

from selfrl.envs import bfcl
from selfrl.envs.base import Env
from selfrl.envs.registry import register_env
from selfrl.core.tasks import Task, assert_disjoint, task_id
from selfrl.chat.toolcall import parse_tool_calls
from selfrl.core.tools import Tool
from selfrl.core.trajectory import Trajectory

__all__ = ["CATEGORIES", "LIVE_CATEGORIES", "FunctionCallingEnv", "partial_score"]

CATEGORIES = ("simple", "multiple", "parallel", "parallel_multiple", "irrelevance")  # the default mix
LIVE_CATEGORIES = bfcl.LIVE_CATEGORIES  # accepted in options.categories too


def _norm(value: Any) -> Any:
    """BFCL's string standardisation: lower case, without spaces and ,./-_*^ (recursively)."""
    if isinstance(value, str):
        return re.sub(r"[ ,./\-_*^]", "", value.lower())
    if isinstance(value, (list, tuple)):
        return [_norm(v) for v in value]
    if isinstance(value, dict):
        return {k: _norm(v) for k, v in value.items()}
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return float(value)
    return value


def _value_ok(value: Any, allowed: list) -> bool:
    return _norm(value) in [_norm(a) for a in allowed if a != ""]


def _call_score(call: dict, name: str, expected: dict, schema: dict | None) -> tuple[bool, float]:
    """``(exact, share of expected arguments right)`` of one call against one possible answer."""
    args = call.get("arguments", {})
    if call.get("name") != name:
        return False, 0.0
    known = set((schema or {}).get("parameters", {}).get("properties", {})) or set(expected)
    unknown = [k for k in args if k not in known]
    right = 0
    exact = not unknown
    for param, allowed in expected.items():
        if param not in args:
            if "" not in allowed:
                exact = False
            else:
                right += 1
            continue
        if _value_ok(args[param], allowed):
            right += 1
        else:
            exact = False
    return exact, right / len(expected) if expected else 1.0


def partial_score(calls: list[dict], ground_truth: list[dict], functions: list[dict]) -> tuple[bool, float]:
    """A lenient match of ``calls`` (``[{"name", "arguments"}]``) against ``ground_truth``
    (``[{name: {param: [allowed values]}}]``; empty: no call is right), for partial credit.

    Returns ``(match, partial)``: whether every expected call is matched (names, values
    among the allowed ones after BFCL's string standardisation, an int accepted for a
    float; no type check), and partial credit: 1.0 when matched, otherwise 0.5 x share
    of expected names called + 0.5 x share of expected argument values right, at most
    0.9. Parallel calls are matched in any order, greedily. The exact verdict is
    ``selfrl.envs.bfcl.ast_match`` (stricter: types, call counts per category).

    >>> gt = [{"f": {"x": [1], "unit": ["m", ""]}}]
    >>> partial_score([{"name": "f", "arguments": {"x": 1}}], gt, [])
    (True, 1.0)
    >>> partial_score([{"name": "f", "arguments": {"x": 2}}], gt, [])
    (False, 0.75)
    >>> partial_score([], [], []), partial_score([{"name": "f", "arguments": {}}], [], [])
    ((True, 1.0), (False, 0.0))
    """
    if not ground_truth:
        return (not calls, 1.0 if not calls else 0.0)
    schemas = {f["name"]: f for f in functions}
    unused = list(range(len(calls)))
    exact = len(calls) == len(ground_truth)
    names = shares = 0.0
    for answer in ground_truth:
        (name, expected), = answer.items()
        best, best_i = (False, -1.0), None
        for i in unused:
            got = _call_score(calls[i], name, expected, schemas.get(name))
            if calls[i].get("name") == name and (got[0], got[1]) > best:
                best, best_i = got, i
        if best_i is None:
            exact = False
            continue
        unused.remove(best_i)
        names += 1
        shares += best[1]
        exact = exact and best[0]
    if exact:
        return True, 1.0
    n = len(ground_truth)
    return False, min(0.9, 0.5 * names / n + 0.5 * shares / n)


class _CallState:
    """One trajectory's record of the calls it made; its tools are the task's functions."""

    demonstration: list[dict[str, str]] | None = None  # set below

    def __init__(self, functions: list[dict]):
        self.calls: list[dict] = []
        self.tools = [Tool(t["function"]["name"], t["function"]["description"][:200], t["function"]["parameters"],
                           self._recorder(t["function"]["name"])) for t in bfcl.to_openai_tools(functions)]

    def _recorder(self, name: str):
        def call(**arguments: Any) -> str:
            self.calls.append({"name": name, "arguments": arguments})
            return "done"
        return call

    def is_completed(self) -> bool:
        return bool(self.calls)

    def state(self) -> dict[str, Any]:
        return {"calls": list(self.calls)}


_DEMO_FN = {"name": "get_weather", "description": "Get the weather of a city.",
            "parameters": {"type": "dict", "properties": {"city": {"type": "string"},
                                                          "unit": {"type": "string"}}, "required": ["city"]}}
DEMONSTRATION: list[dict[str, str]] = [
    {"role": "user", "content": "What is the weather in Paris in celsius?"},
    {"role": "assistant", "content": '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", '
                                     '"unit": "celsius"}}</tool_call>'},
    {"role": "tool", "content": "<tool_response>\ndone\n</tool_response>"},
    {"role": "assistant", "content": "Done."},
]
_CallState.demonstration = DEMONSTRATION


def canonical_calls(state: dict[str, Any] | None) -> str | None:
    """The calls of a trajectory as canonical JSON (sorted keys; calls sorted), for agreement and scoring."""
    if state is None:
        return None
    return json.dumps(sorted((c for c in state["calls"]), key=lambda c: json.dumps(c, sort_keys=True)),
                      sort_keys=True)


class FunctionCallingEnv(Env):
    """BFCL function calling; see the module docstring."""

    name = "function_calling"
    description: ClassVar[str] = ("BFCL v4 simple/multiple/parallel/parallel_multiple/irrelevance; "
                                  "tools: the task's functions; reward: AST match")
    preset: ClassVar[str] = "function_calling"
    config_defaults: ClassVar[dict[str, Any]] = {
        "preset": "function_calling", "rollout.tools": [], "rollout.max_turns": 2, "rollout.max_new_tokens": 96,
        "rollout.stop_at_tool_call": False,
        "rollout.system_prompt": "You are a function-calling assistant. Call the functions that answer the "
                                 "user's request, with the right arguments; if none fits, answer without a call.",
        "gate.val_size": 96, "task.num_train": 400,
    }

    def __init__(self, categories: list[str] | None = None, max_per_category: int | None = None,
                 shots: int = 0, max_params: int | None = None):
        """``categories``: the BFCL categories to use (default: all of ``CATEGORIES``; the
        ``LIVE_CATEGORIES`` may be named too);
        ``max_per_category``: keep only the first tasks of each (in hash order);
        ``shots``: worked examples shown before each task: 0 is the one fixed ``get_weather``
        example, k > 0 is k real BFCL tasks of the same categories solved with their first
        possible answer (the k-shot prompt baseline; they are never held out: they come from
        the end of the hash order and are removed from the task pool);
        ``max_params``: keep only tasks whose functions have at most this many parameters
        each (an easier subset).

        Raises:
            ValueError: an unknown category (lists the valid ones), or more shots than the
                categories can give (live_relevance gives none: it has no answer to show).
        """
        cats = list(categories or CATEGORIES)
        bad = [c for c in cats if c not in CATEGORIES + LIVE_CATEGORIES]
        if bad:
            raise ValueError(f"unknown BFCL categories {bad}; valid: {', '.join(CATEGORIES + LIVE_CATEGORIES)}")
        self.categories = cats
        self.by_category: dict[str, list[Task]] = {}
        self.left_out: dict[str, Counter] = {}  # category -> why -> questions not made tasks
        for c in cats:
            items, skipped = [], Counter()
            for item in bfcl.load_bfcl([c]):
                why = _unfit(item)
                if why is None:
                    items.append(item)
                else:
                    skipped[why] += 1
            if skipped:
                self.left_out[c] = skipped
            tasks = sorted((self._task(c, item) for item in items),
                           key=lambda t: hashlib.sha256(t.metadata["bfcl_id"].encode()).hexdigest())
            if max_params is not None:
                tasks = [t for t in tasks if all(len(f.get("parameters", {}).get("properties", {})) <= max_params
                                                 for f in t.metadata["functions"])]
            self.by_category[c] = tasks[:max_per_category] if max_per_category else tasks
        if shots < 0:
            raise ValueError(f"shots must be >= 0, got {shots}")
        examples: list[Task] = []
        showable = [c for c in cats if c != "live_relevance"]  # no right answer to show
        if shots and not showable:
            raise ValueError("live_relevance has no possible answer to show as a worked example; "
                             "use shots = 0 or add another category")
        for i in range(shots):  # round-robin over the categories, from the end of each list
            c = showable[i % len(showable)]
            if len(self.by_category[c]) < 2:
                raise ValueError(f"category {c!r} has too few tasks for {shots} shots")
            examples.append(self.by_category[c].pop())
        self.demonstration = _shots(examples) if examples else DEMONSTRATION

    def _task(self, category: str, item: bfcl.BfclTask) -> Task:
        # a live question's system message comes first (the run's system prompt stays the system's)
        question = "\n\n".join(m["content"] for m in item.messages if m["role"] in ("system", "user"))
        meta = {"bfcl_id": item.id, "category": category, "bfcl_category": item.category,
                "messages": list(item.messages), "functions": list(item.functions),
                "ground_truth": list(item.ground_truth)}
        # The id hashes the functions too: BFCL repeats a question with other functions.
        key = question + "\x00" + json.dumps(list(item.functions), sort_keys=True)
        return Task(task_id(self.name, key), self.name, question, json.dumps(list(item.ground_truth)), meta)

    def sample(self, n: int, seed: int) -> list[Task]:
        import random

        pool = [t for c in self.categories for t in self.by_category[c]]
        rng = random.Random(seed)
        return [rng.choice(pool) for _ in range(max(n, 0))]

    def split(self, n_train: int, n_val: int, train_seed: int, val_seed: int) -> tuple[list[Task], list[Task]]:
        """Held out: ``n_val`` tasks over the categories in proportion to their size (the first in hash
        order); training: up to ``n_train`` of the rest, round-robin over the categories.

        Raises:
            ValueError: ``n_val`` is more than half the tasks.
        """
        total = sum(len(v) for v in self.by_category.values())
        if n_val > total // 2:
            raise ValueError(f"function_calling: {n_val} held-out tasks is more than half of the {total}")
        val, rest = [], []
        quotas = _quotas({c: len(v) for c, v in self.by_category.items()}, n_val)
        for c, tasks in self.by_category.items():
            val += tasks[:quotas[c]]
            rest.append(tasks[quotas[c]:])
        val_ids = {t.id for t in val}
        train = [t for t in _interleave(rest) if t.id not in val_ids][:n_train]  # a repeated item stays held out
        assert_disjoint(train, val)
        return train, val

    def make_env(self, task: Task) -> _CallState:
        state = _CallState(task.metadata["functions"])
        state.demonstration = self.demonstration
        return state

    def trajectory_answer(self, traj: Trajectory) -> str | None:
        """The calls the trajectory dispatched (its state), as canonical JSON; when it dispatched
        none, the well-formed calls written in its last assistant message (a call written on the
        last allowed turn is parsed but never dispatched, so ``max_turns = 1`` works)."""
        if traj.env_state is None:
            return None
        if traj.env_state["calls"]:
            return canonical_calls(traj.env_state)
        last = next((m["content"] for m in reversed(traj.messages) if m["role"] == "assistant"), "")
        calls = [{"name": c.name, "arguments": c.arguments} for c in parse_tool_calls(last)[1] if c.error is None]
        return canonical_calls({"calls": calls})

    def extract_answer(self, text: str) -> str | None:  # answers come from the recorded calls, not the text
        return None

    def score(self, task: Task, answer: str | None) -> float:
        """1.0 when the calls ``answer`` (canonical JSON) pass BFCL's AST match, else the partial
        credit of ``partial_score`` (at most 0.9). No answer (no state) scores as no call.

        Raises:
            ValueError: the task is from another source.
        """
        if task.source != self.name:
            raise ValueError(f"task {task.id} is from source {task.source!r}, not {self.name!r}")
        calls = json.loads(answer) if answer else []
        m = task.metadata
        if bfcl.ast_match(_bfcl_task(task), bfcl.calls_from_openai(calls)).valid:
            return 1.0
        if m["bfcl_category"] == "live_relevance":  # no right values: nothing to be partly right about
            return 0.0
        return min(0.9, partial_score(calls, m["ground_truth"], m["functions"])[1])

    def agreement_scores(self, task: Task, group: list[Trajectory]) -> dict[str, float | None]:
        """Label-free: ``selfrl.envs.bfcl.call_agreement`` over the group's calls (None for a group of one)."""
        if len(group) < 2:
            return {t.id: None for t in group}
        answers = [self.trajectory_answer(t) for t in group]
        samples = [None if a is None else bfcl.calls_from_openai(json.loads(a)) for a in answers]
        return dict(zip((t.id for t in group), bfcl.call_agreement(samples)))


def _bfcl_task(task: Task) -> bfcl.BfclTask:
    m = task.metadata
    return bfcl.BfclTask(m["bfcl_id"], m["bfcl_category"], tuple(m["messages"]), tuple(m["functions"]),
                         tuple(m["ground_truth"]))


def _unfit(item: bfcl.BfclTask) -> str | None:
    """Why a BFCL question is not made a task here, or None: a conversation (an assistant turn
    before the request: a task is one request) or no function offered (nothing to call)."""
    if [m["role"] for m in item.messages if m["role"] != "system"] != ["user"]:
        return "a conversation, not one request"
    if not item.functions:
        return "no function offered"
    return None


def _first(value: Any) -> Any:
    """A possible answer's value as a call would give it: a dict of accepted values per key
    (live answers nest them) becomes the first of each, a key whose first is "" (optional)
    left out, as at the top level.

    >>> _first({"size": ["large"], "milk": ["", "oat"]})
    {'size': 'large'}
    """
    if isinstance(value, dict):
        return {k: _first(v[0]) for k, v in value.items() if v and v[0] != ""}
    if isinstance(value, list) and value and all(isinstance(x, dict) for x in value):
        return [_first(x) for x in value]
    return value


def first_answer_calls(task: Task) -> list[dict[str, Any]]:
    """The task's first possible answer as calls ``[{"name", "arguments": {...}}]`` (each argument
    its first accepted value, optional ones left out); [] for a task whose right answer is no call.

    >>> t = Task("t", "function_calling", "q", "", {"ground_truth": [{"f": {"x": [1, 2], "y": ["", 3]}}]})
    >>> first_answer_calls(t)
    [{'name': 'f', 'arguments': {'x': 1}}]
    """
    return [{"name": name, "arguments": {p: _first(v[0]) for p, v in args.items() if v and v[0] != ""}}
            for answer in task.metadata.get("ground_truth") or [] for name, args in answer.items()]


def _shots(examples: list[Task]) -> list[dict[str, str]]:
    """Worked examples: each task's question, then its first possible answer as calls."""
    out: list[dict[str, str]] = []
    for t in examples:
        calls = first_answer_calls(t)
        out.append({"role": "user", "content": t.question})
        if calls:
            out.append({"role": "assistant", "content": "".join(
                f"<tool_call>{json.dumps(c)}</tool_call>" for c in calls)})
            out.append({"role": "tool", "content": "<tool_response>\ndone\n</tool_response>"})
            out.append({"role": "assistant", "content": "Done."})
        else:
            out.append({"role": "assistant", "content": "None of the functions fits this request."})
    return out


def _quotas(sizes: dict[str, int], n: int) -> dict[str, int]:
    """``n`` split over ``sizes`` in proportion, by largest remainders.

    >>> _quotas({"a": 300, "b": 100}, 8)
    {'a': 6, 'b': 2}
    """
    total = sum(sizes.values())
    raw = {c: n * s / total for c, s in sizes.items()}
    q = {c: int(r) for c, r in raw.items()}
    for c in sorted(raw, key=lambda c: raw[c] - q[c], reverse=True)[: n - sum(q.values())]:
        q[c] += 1
    return q


def _interleave(lists: list[list[Task]]) -> list[Task]:
    out, i = [], 0
    while any(i < len(lst) for lst in lists):
        out += [lst[i] for lst in lists if i < len(lst)]
        i += 1
    return out


register_env("function_calling", FunctionCallingEnv)

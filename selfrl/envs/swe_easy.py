"""The easy tier of repository repair: the bug's function is shown, and one edit fixes it.

The full tier (``selfrl.envs.swe``) asks the agent to find the bug with file tools over
several turns; a 135M model gets no reward there. The easy tier removes the search and
keeps the repair (``[task] options = { tier = "easy" }``):

* **Instances**: the generated ones whose fix changes exactly one line, and whose buggy
  line (without its indentation) occurs once in its file: 116 of the 135 (the 17
  ``remove_branch`` bugs need lines added back; 2 ``flip_comparison`` bugs sit on a line
  that occurs twice). A local SWE-bench instance has no known fix line and is refused.
* **Prompt**: the problem statement (the failing tests and their messages), the test lines
  those messages point at (a bare ``AssertionError`` says nothing; ``assert f(2) == 4``
  does), then the innermost function that holds the bug, by name and file, with numbered lines.
* **Tool**: only ``edit(path, old, new)``. Its schema names the one file (``enum``) and
  lists the function's lines that are unique in the file as the allowed ``old`` values
  (``enum``, stripped of indentation: ``edit`` replaces a substring, so the indentation
  stays). With ``rollout.constrain = "tool_call"`` the grammar enforces the schema: the
  model picks a line and writes its replacement. Without the grammar the tool still checks
  its arguments against the schema (``selfrl.chat.toolcall``): a test file cannot be named, so
  test edits, skips, deletions and conftest hooks are out of reach on this tier; the trick
  left is special-casing the tested inputs inside the function (say, through its ``def``
  line), which the ``swe_hardcoded_output`` detector flags.
* **The ``line`` tier** (``tier = "line"``), easier still: the prompt also names the buggy
  line, and it is the only allowed ``old``: the model only writes the fixed line.
* **The ``choice`` tier** (``tier = "choice"``, ``choices = k``, default 4), multiple choice:
  as ``line``, and ``new`` is an ``enum`` too, of k candidate lines (``choice_options``):
  the fix (the clean line), the buggy line itself, and other one-node mutants of the clean
  line (``swe_tasks.candidate_mutations`` of the clean file whose span lies on the bug's
  line) that the generator kept as bugs (``SweEnv`` passes each line's known buggy
  versions), so every distractor is a real bug of that line and only the fix is paid.
  Fewer than k when the line has fewer (116 instances: 69 with 4, 28 with 3, 19 with 2; one
  with fewer than 2 would be skipped); the order is a shuffle seeded by the instance id, so
  a position carries no signal. A pick at random fixes the bug with a chance of 1/k.
  It measures choosing the right line among plausible variants given the failing tests,
  not finding the bug or writing a fix.
* **One round**: the episode ends after the first edit that applies
  (``RepoState.is_completed``); a refused edit leaves another turn.

The reward and the detectors are the full tier's: the edited repository's FAIL_TO_PASS and
PASS_TO_PASS run on a clean copy with the original tests restored.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import random
import re
from collections.abc import Collection
from dataclasses import dataclass, replace
from typing import Any

from selfrl.envs.swe_tasks import Instance, candidate_mutations, load_repo
from selfrl.envs.swe_testing import is_test_path

__all__ = ["CHOICE_DEMONSTRATION", "EASY_DEMONSTRATION", "EasyView", "choice_options", "choice_view",
           "easy_question", "easy_view", "edit_schema"]


@dataclass(frozen=True)
class EasyView:
    """What the easy tier shows of one instance, and its one-line fix.

    Attributes:
        path: the buggy module's relative path.
        function: the name of the innermost function holding the bug.
        first_line: the 1-based line of its ``def``.
        source: its lines, as in the buggy file (from ``def`` to its last line).
        choices: the stripped, non-blank lines of ``source`` that occur once in the file
            (the allowed ``old`` values, in source order; the buggy line is among them).
        fix: ``{"path", "old", "new"}``: the buggy line and the clean line, both stripped.
        bug_line: the buggy line's 1-based number.
        named: the ``line`` tier: the prompt names the buggy line and it is the only choice.
        options: the ``choice`` tier: the allowed ``new`` values (stripped lines, the fix among
            them, in the order shown); empty: ``new`` is free text.
    """

    path: str
    function: str
    first_line: int
    source: tuple[str, ...]
    choices: tuple[str, ...]
    fix: dict[str, str]
    bug_line: int = 0
    named: bool = False
    options: tuple[str, ...] = ()

    def numbered(self) -> str:
        """The function with line numbers as ``read_file`` shows them."""
        return "\n".join(f"{self.first_line + i:4d}  {line}" for i, line in enumerate(self.source))


def easy_view(inst: Instance, named: bool = False) -> EasyView | None:
    """The easy-tier view of a generated instance, or None when its fix is not one unique line
    (or it has no known fix: a SWE-bench instance). ``named``: the ``line`` tier (the buggy
    line is named and is the only allowed ``old``)."""
    e = inst.reference_edit
    if not e or e["path"] not in inst.bug_files:
        return None
    buggy = inst.bug_files[e["path"]]
    clean = load_repo(inst.repo)[e["path"]]
    b_lines, c_lines = buggy.splitlines(), clean.splitlines()
    if len(b_lines) != len(c_lines):
        return None
    changed = [i for i, (b, c) in enumerate(zip(b_lines, c_lines)) if b != c]
    if len(changed) != 1:
        return None
    line_no = changed[0] + 1
    bad, good = b_lines[changed[0]].strip(), c_lines[changed[0]].strip()
    if buggy.count(bad) != 1:
        return None
    fns = [n for n in ast.walk(ast.parse(buggy)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
           and n.lineno <= line_no <= (n.end_lineno or n.lineno)]
    if not fns:
        return None
    fn = min(fns, key=lambda n: (n.end_lineno or n.lineno) - n.lineno)
    source = tuple(b_lines[fn.lineno - 1:fn.end_lineno])
    choices = (bad,) if named else tuple(s for s in (line.strip() for line in source) if s and buggy.count(s) == 1)
    return EasyView(e["path"], fn.name, fn.lineno, source, choices, {"path": e["path"], "old": bad, "new": good},
                    line_no, named)


_WHERE = re.compile(r"\(([\w./-]+\.py):(\d+)\)")


def failing_lines(inst: Instance, limit: int = 3) -> list[str]:
    """The test lines the problem statement's messages point at (``path:line: text``), at most ``limit``.

    A failed ``assert`` says nothing more than ``AssertionError``; its line shows the call and
    the expected value."""
    files, out = None, []
    for path, line in _WHERE.findall(inst.problem_statement):
        if not is_test_path(path):
            continue
        files = files or inst.files()
        lines = files.get(path, "").splitlines()
        shown = f"{path}:{line}: {lines[int(line) - 1].strip()}" if 0 < int(line) <= len(lines) else None
        if shown and shown not in out:
            out.append(shown)
    return out[:limit]


def easy_question(inst: Instance, view: EasyView) -> str:
    """The easy-tier prompt: the problem statement, the failing test lines, then the buggy
    function with numbered lines (and, on the ``choice`` tier, the numbered candidates)."""
    checks = failing_lines(inst)
    shown = "The failing lines:\n" + "\n".join(checks) + "\n" if checks else ""
    if view.options:
        listed = "\n".join(f"{i}. {o}" for i, o in enumerate(view.options, 1))
        ask = (f"The bug is on line {view.bug_line}. Fix it with one edit: old is that line, new is the fixed line, "
               f"one of these {len(view.options)}:\n{listed}\nPick the one that makes the failing tests pass.")
    elif view.named:
        ask = f"The bug is on line {view.bug_line}. Fix it with one edit: old is that line, new is that line fixed."
    else:
        ask = "Fix it with one edit: old is the buggy line, new is that line fixed."
    return (f"{inst.problem_statement}\n{shown}The bug is in the function {view.function} of {view.path}:\n"
            f"{view.numbered()}\n{ask}")


def edit_schema(view: EasyView) -> dict[str, Any]:
    """The JSON schema of the easy tier's ``edit`` arguments: this file, one of the allowed lines, any
    text (the ``choice`` tier: one of the candidates).

    >>> v = EasyView("p/m.py", "f", 1, ("def f(x):", "    return x + 1"), ("def f(x):", "return x + 1"),
    ...              {"path": "p/m.py", "old": "return x + 1", "new": "return x - 1"})
    >>> edit_schema(v)["properties"]["old"]
    {'type': 'string', 'enum': ['def f(x):', 'return x + 1']}
    """
    return {"type": "object", "properties": {
        "path": {"type": "string", "enum": [view.path]},
        "old": {"type": "string", "enum": list(view.choices)},
        "new": {"type": "string", "enum": list(view.options)} if view.options else {"type": "string"},
    }, "required": ["path", "old", "new"]}


@functools.lru_cache(maxsize=64)
def _line_mutants(repo: str, path: str) -> dict[int, list[str]]:
    """``{line number: [the line, stripped, after each mutation of the clean file that lies on it alone]}``."""
    clean = load_repo(repo)[path]
    lines = clean.splitlines(keepends=True)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))
    out: dict[int, list[str]] = {}
    for m in candidate_mutations(path, clean):
        end_of_line = starts[m.line - 1] + len(lines[m.line - 1].rstrip("\n"))
        if m.end <= end_of_line:
            out.setdefault(m.line, []).append(m.apply(clean).splitlines()[m.line - 1].strip())
    return out


def choice_options(inst: Instance, view: EasyView, k: int, failing: Collection[str] | None = None) -> tuple[str, ...]:
    """At most ``k`` candidate lines for the named buggy line, stripped and distinct, in a
    shuffled order seeded by ``inst.instance_id``: the fix (the clean line), the buggy line,
    then other mutants of the clean line (each ``candidate_mutations`` of the clean file whose
    span lies on the bug's line, applied alone), as many as fit, drawn by the same seed.
    ``failing``: the variants of this line known to fail some test (the buggy lines of the
    generated instances at this spot); when given, other mutants are left out: one that breaks
    no test would be a second right answer, and one that loops forever gets no verdict.

    Raises:
        ValueError: ``k < 2``.
    """
    if k < 2:
        raise ValueError(f"choices must be >= 2 (the fix and at least one other line), got {k}")
    mutants = _line_mutants(inst.repo, view.path).get(view.bug_line, [])
    fix, bad = view.fix["new"], view.fix["old"]
    others = [m for m in dict.fromkeys(mutants) if m not in (fix, bad) and (failing is None or m in failing)]
    rng = random.Random(int(hashlib.sha256(inst.instance_id.encode()).hexdigest()[:16], 16))
    rng.shuffle(others)
    options = [fix, bad] + others[:k - 2]
    rng.shuffle(options)
    return tuple(options)


def choice_view(inst: Instance, view: EasyView, k: int, failing: Collection[str] | None = None) -> EasyView | None:
    """The ``choice``-tier view: the ``line`` tier's ``view`` (``easy_view(inst, named=True)``) with
    ``choice_options(inst, view, k, failing)`` as the allowed ``new``; None when there are fewer
    than 2 candidates.

    Raises:
        ValueError: ``k < 2``.
    """
    options = choice_options(inst, view, k, failing)
    return replace(view, options=options) if len(options) >= 2 else None


def _call(path: str, old: str, new: str) -> str:
    return f'<tool_call>{json.dumps({"name": "edit", "arguments": {"path": path, "old": old, "new": new}})}</tool_call>'


# The worked example's task, shared by the easy and choice tiers (only the last request differs).
_DEMO_TASK = ("The repository calc has a bug: these tests fail.\n"
              "- tests/test_calc.py::test_double: AssertionError: assert 5 == 6\n"
              "Find the bug in the package's code and fix it. Do not change the tests.\n"
              "The bug is in the function double of calc/ops.py:\n"
              "   4  def double(x):\n   5      \"\"\"Twice x.\"\"\"\n   6      return x + 2\n")


def _demonstration(ask: str) -> list[dict[str, str]]:
    """The worked example: the shared task with ``ask`` appended, its fix as one edit, the tool's reply."""
    return [{"role": "user", "content": _DEMO_TASK + ask},
            {"role": "assistant", "content": _call("calc/ops.py", "return x + 2", "return x * 2")},
            {"role": "tool", "content": "<tool_response>\nedited calc/ops.py\n</tool_response>"}]


# The worked example shown before an easy-tier task (``shots = 0``): one edit, and the episode ends.
EASY_DEMONSTRATION = _demonstration("Fix it with one edit: old is the buggy line, new is that line fixed.")

# The worked example shown before a choice-tier task (``shots = 0``): one pick among candidates.
CHOICE_DEMONSTRATION = _demonstration(
    "The bug is on line 6. Fix it with one edit: old is that line, new is the fixed line, "
    "one of these 4:\n1. return x - 2\n2. return x + 2\n3. return x * 2\n4. return x + 3\n"
    "Pick the one that makes the failing tests pass.")


def easy_shot(inst: Instance, view: EasyView) -> list[dict[str, str]]:
    """A real solved instance as a worked example: its question, its fix as one edit, the tool's reply."""
    return [{"role": "user", "content": easy_question(inst, view)},
            {"role": "assistant", "content": _call(**view.fix)},
            {"role": "tool", "content": f"<tool_response>\nedited {view.path}\n</tool_response>"}]

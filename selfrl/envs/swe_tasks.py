"""Repository-repair task instances: made by mutating working code (SWE-smith style), or read
from SWE-bench-format files kept locally.

**Generated instances** (``generate``). The repositories are small pure-Python
packages shipped with selfrl (``selfrl/envs/swe-repos/<name>``: ``ministats``,
``minitext``, ``intervals``), each with its own tests, all passing. Every
non-test module is parsed and each candidate mutation site is enumerated:

* ``flip_comparison``: ``<``/``>``, ``<=``/``>=``, ``==``/``!=`` swapped (a
  comparison turned around);
* ``boundary``: ``<`` <-> ``<=``, ``>`` <-> ``>=`` (a boundary moved);
* ``off_by_one``: an integer literal ``n`` in arithmetic, an index or a call becomes ``n + 1``;
* ``swap_operator``: ``+``/``-``, ``*``/``/``, ``//``/``/``, ``and``/``or`` swapped;
* ``remove_branch``: an ``if`` without ``else`` that is not alone in its block is deleted.

A mutation is applied to the source text in place (only the mutated node's
text changes, so the bug is a small diff, not a reformatted file). It is kept
when some test that passed before now fails (a run killed by its time limit, e.g. an
endless loop, is dropped: it names no test); its FAIL_TO_PASS are those tests,
its PASS_TO_PASS the tests that pass both before and after. SWE-smith
(Yang et al., 2025) departs from this in two ways we do not follow: it also
rewrites whole functions with an LLM, and it writes the problem statement with
an LLM; here the statement is made from the failing tests' names and messages.

**Local SWE-bench instances** (``read_swebench``): a JSON or JSONL file of
records with ``instance_id``, ``problem_statement``, ``FAIL_TO_PASS``,
``PASS_TO_PASS`` (lists, or JSON strings of lists, as SWE-bench ships them),
plus ``repo_dir``: a checkout at the buggy commit on this machine. Their tests
run under the same runner (``selfrl.envs.swe_testing``): plain ``test_*``
functions with ``pytest.raises``/``approx``/marks only, so a repository that
needs pytest fixtures or third-party packages will not run.
"""

from __future__ import annotations

import ast
import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from selfrl.envs.swe_testing import is_test_path, run_repo_tests
from selfrl.envs.sandbox import Limits, Sandbox

__all__ = ["REPOS", "REPOS_DIR", "Instance", "Mutation", "candidate_mutations", "generate",
           "load_instances", "load_repo", "read_swebench"]

REPOS_DIR = Path(__file__).with_name("swe-repos")
REPOS = ("ministats", "minitext", "intervals")
TASKS_FILE = REPOS_DIR / "tasks.json"  # the generated instances, shipped (``python -m selfrl.envs.swe_tasks``)
KINDS = ("flip_comparison", "boundary", "off_by_one", "swap_operator", "remove_branch")

_FLIP = {ast.Lt: ast.Gt, ast.Gt: ast.Lt, ast.LtE: ast.GtE, ast.GtE: ast.LtE, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq}
_BOUNDARY = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt}
_SWAP = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Div}


def load_repo(source: str | Path) -> dict[str, str]:
    """``{relative path: text}`` of a shipped repository's name or a directory (no caches, no ``.git``).

    Raises:
        FileNotFoundError: no such repository or directory.
    """
    root = REPOS_DIR / source if isinstance(source, str) and "/" not in source else Path(source)
    if not root.is_dir():
        raise FileNotFoundError(f"no repository {source!r}; shipped ones: {', '.join(REPOS)}")
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_file() and not any(part in ("__pycache__", ".git") for part in p.parts) \
                and p.suffix in (".py", ".md", ".txt", ".cfg", ".toml", ".ini"):
            out[rel] = p.read_text()
    return out


@dataclass(frozen=True)
class Mutation:
    """One candidate bug: replace ``old`` (the exact text of a node or a span of lines) in ``path``.

    Attributes:
        kind: one of ``KINDS``.
        path: the module's relative path.
        start, end: character offsets of ``old`` in the original text.
        old, new: the original text and its mutated replacement.
        line: the 1-based line where the mutation starts.
    """

    kind: str
    path: str
    start: int
    end: int
    old: str
    new: str
    line: int

    def apply(self, text: str) -> str:
        """``text`` with the mutation applied.

        Raises:
            ValueError: ``text`` does not hold ``old`` at ``start``.
        """
        if text[self.start:self.end] != self.old:
            raise ValueError(f"{self.path}:{self.line}: the text at the mutation site changed")
        return text[:self.start] + self.new + text[self.end:]


def _offsets(text: str) -> list[int]:
    starts, pos = [], 0
    for line in text.splitlines(keepends=True):
        starts.append(pos)
        pos += len(line)
    return starts + [pos]


def _span(text: str, lines: list[int], node: ast.AST) -> tuple[int, int]:
    # col offsets are UTF-8 byte offsets; the shipped repositories are ASCII (checked in generate)
    return lines[node.lineno - 1] + node.col_offset, lines[node.end_lineno - 1] + node.end_col_offset


def candidate_mutations(path: str, text: str) -> Iterator[Mutation]:
    """Every candidate mutation of one module, in source order within each kind (see the module docstring)."""
    tree, lines = ast.parse(text), _offsets(text)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

    def node_mutation(kind: str, node: ast.AST, mutated: ast.AST) -> Mutation:
        s, e = _span(text, lines, node)
        return Mutation(kind, path, s, e, text[s:e], ast.unparse(mutated), node.lineno)

    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and len(node.ops) == 1:
            for kind, table in (("flip_comparison", _FLIP), ("boundary", _BOUNDARY)):
                op = table.get(type(node.ops[0]))
                if op is not None:
                    yield node_mutation(kind, node, ast.Compare(node.left, [op()], node.comparators))
        elif isinstance(node, ast.BinOp) and type(node.op) in _SWAP:
            yield node_mutation("swap_operator", node, ast.BinOp(node.left, _SWAP[type(node.op)](), node.right))
        elif isinstance(node, ast.BoolOp):
            other = ast.Or() if isinstance(node.op, ast.And) else ast.And()
            yield node_mutation("swap_operator", node, ast.BoolOp(other, node.values))
        elif (isinstance(node, ast.Constant) and type(node.value) is int
              and isinstance(parents.get(node), (ast.BinOp, ast.Subscript, ast.Slice, ast.Call))):
            yield node_mutation("off_by_one", node, ast.Constant(node.value + 1))
        elif isinstance(node, ast.If) and not node.orelse:
            block = next(getattr(parents[node], f) for f in ("body", "orelse", "finalbody")
                         if node in getattr(parents[node], f, []))
            if len(block) > 1:
                s, e = lines[node.lineno - 1], lines[node.end_lineno]
                yield Mutation("remove_branch", path, s, e, text[s:e], "", node.lineno)


@dataclass
class Instance:
    """One repository-repair task, in SWE-bench's vocabulary.

    Attributes:
        instance_id: unique id (``ministats__core-7`` for a generated one).
        repo: a shipped repository's name, or a directory for a local SWE-bench instance.
        problem_statement: what the agent is told.
        fail_to_pass: tests that fail on the buggy repository and must pass after the fix.
        pass_to_pass: tests that pass on it and must keep passing.
        bug_files: ``{path: text}`` that turn the clean repository into the buggy one (empty:
            ``repo`` is already buggy, as for SWE-bench instances).
        kind: the mutation kind (``KINDS``), or "swebench".
        reference_edit: ``{"path", "old", "new"}``, an edit that fixes the bug (``old`` is unique
            in the buggy file); empty when unknown.
    """

    instance_id: str
    repo: str
    problem_statement: str
    fail_to_pass: list[str]
    pass_to_pass: list[str]
    bug_files: dict[str, str] = field(default_factory=dict)
    kind: str = "swebench"
    reference_edit: dict[str, str] = field(default_factory=dict)

    def files(self) -> dict[str, str]:
        """The buggy repository: ``{relative path: text}``."""
        return {**load_repo(self.repo), **self.bug_files}


def _unique_context(text: str, start: int, end: int) -> tuple[int, int]:
    """Grow ``[start, end)`` to whole lines, then by a line at a time until the span's text is unique."""
    lines = _offsets(text)
    lo = max(i for i, p in enumerate(lines) if p <= start)
    hi = min(i for i, p in enumerate(lines) if p >= end) if end > start else lo + 1
    hi = max(hi, lo + 1)
    while text.count(text[lines[lo]:lines[hi]]) > 1 and (lo > 0 or hi < len(lines) - 1):
        lo, hi = max(lo - 1, 0), min(hi + 1, len(lines) - 1)
    return lines[lo], lines[hi]


def _statement(repo: str, f2p: list[str], messages: dict[str, str]) -> str:
    shown = "\n".join(f"- {t}: {messages.get(t, '')}" for t in f2p[:4])
    more = f"\n(and {len(f2p) - 4} more)" if len(f2p) > 4 else ""
    return (f"The repository {repo} has a bug: these tests fail.\n{shown}{more}\n"
            "Find the bug in the package's code and fix it. Do not change the tests.")


def _expand(outcomes: dict[str, str], clean_ids: list[str]) -> dict[str, str]:
    """Outcomes per test id: a file that failed to import (``path::*``) gives its clean tests its outcome.

    >>> _expand({"t.py::*": "error", "u.py::b": "passed"}, ["t.py::a", "u.py::b"])
    {'t.py::a': 'error', 'u.py::b': 'passed'}
    """
    out = {}
    for t in clean_ids:
        whole = t.split("::")[0] + "::*"
        out[t] = outcomes.get(t, outcomes.get(whole, "missing"))
    return out


def generate(repo: str, sandbox: Sandbox | None = None) -> tuple[list[Instance], dict[str, Any]]:
    """Mutate every candidate site of ``repo``'s modules, one at a time, and keep the ones that break tests.

    Returns:
        ``(instances, report)``; the report counts ``candidates`` and ``kept`` per kind
        and ``dropped`` by reason (``no_test_fails``; ``no_report``: the run was killed, e.g.
        an endless loop; ``unchanged``).

    Raises:
        ValueError: the clean repository's tests do not all pass, or a module is not ASCII.
    """
    sandbox = sandbox or Sandbox(Limits(wall_seconds=20))
    files = load_repo(repo)
    clean = run_repo_tests(files, None, sandbox)
    if not clean.passed(list(clean.outcomes)) or not clean.outcomes:
        raise ValueError(f"{repo}: the clean repository's tests do not all pass: {clean.messages}")
    out: list[Instance] = []
    cands: Counter = Counter()
    kept: Counter = Counter()
    dropped: Counter = Counter()
    for path, text in files.items():
        if not path.endswith(".py") or is_test_path(path):
            continue
        if not text.isascii():
            raise ValueError(f"{repo}/{path} is not ASCII (mutation offsets assume it)")
        for n, m in enumerate(candidate_mutations(path, text)):
            cands[m.kind] += 1
            buggy = m.apply(text)
            if buggy == text:
                dropped["unchanged"] += 1
                continue
            run = run_repo_tests({**files, path: buggy}, None, sandbox)
            if not run.reported:  # an endless loop or a crash of the runner: no test ids to record
                dropped["no_report"] += 1
                continue
            outcomes = _expand(run.outcomes, list(clean.outcomes))
            f2p = sorted(t for t, o in outcomes.items() if o != "passed")
            if not f2p:
                dropped["no_test_fails"] += 1
                continue
            kept[m.kind] += 1
            p2p = sorted(t for t, o in outcomes.items() if o == "passed")
            delta = len(m.new) - len(m.old)
            s, e = _unique_context(buggy, m.start, m.end + delta)
            fixed_s, fixed_e = s, e - delta
            module = Path(path).stem
            out.append(Instance(
                f"{repo}__{module}-{n}", repo, _statement(repo, f2p, run.messages), f2p, p2p, {path: buggy}, m.kind,
                {"path": path, "old": buggy[s:e], "new": text[fixed_s:fixed_e]}))
    missing = [i.instance_id for i in out if set(i.fail_to_pass + i.pass_to_pass) != set(clean.outcomes)]
    assert not missing, f"instances that lost test ids: {missing}"
    report = {"repo": repo, "tests": len(clean.outcomes), "candidates": dict(cands), "kept": dict(kept),
              "dropped": dict(dropped), "n_candidates": sum(cands.values()), "n_kept": sum(kept.values())}
    return out, report


def read_swebench(path: str | Path, repo_dir: str | Path | None = None) -> list[Instance]:
    """SWE-bench-format instances from a JSON list or JSONL file.

    Args:
        path: the file; each record has ``instance_id``, ``problem_statement``,
            ``FAIL_TO_PASS``, ``PASS_TO_PASS`` and ``repo_dir`` (unless given here).
        repo_dir: the checkout for every record (overrides the records' ``repo_dir``); a
            relative ``repo_dir`` is taken from the file's folder.

    Raises:
        ValueError: a record lacks a field, a test list is malformed, or a repository folder is missing.
    """
    path = Path(path)
    text = path.read_text()
    records = json.loads(text) if text.lstrip().startswith("[") else [json.loads(ln) for ln in text.splitlines()
                                                                       if ln.strip()]
    out = []
    for i, r in enumerate(records):
        missing = [k for k in ("instance_id", "problem_statement", "FAIL_TO_PASS", "PASS_TO_PASS") if k not in r]
        where = repo_dir or r.get("repo_dir")
        if missing or where is None:
            raise ValueError(f"{path} record {i}: missing {missing + ([] if where else ['repo_dir'])}")
        tests = {}
        for k in ("FAIL_TO_PASS", "PASS_TO_PASS"):
            v = json.loads(r[k]) if isinstance(r[k], str) else r[k]
            if not isinstance(v, list) or not all(isinstance(t, str) for t in v):
                raise ValueError(f"{path} record {i}: {k} must be a list of test ids, got {r[k]!r}")
            tests[k] = v
        if not tests["FAIL_TO_PASS"]:
            raise ValueError(f"{path} record {i}: FAIL_TO_PASS is empty")
        folder = Path(where) if Path(where).is_absolute() else path.parent / where
        if not folder.is_dir():
            raise ValueError(f"{path} record {i}: repository folder {folder} does not exist")
        out.append(Instance(r["instance_id"], str(folder.resolve()), r["problem_statement"],
                            tests["FAIL_TO_PASS"], tests["PASS_TO_PASS"]))
    return out


def load_instances(path: str | Path | None = None) -> list[Instance]:
    """The shipped generated instances (``TASKS_FILE``), or those of a file written by ``main``."""
    data = json.loads(Path(path or TASKS_FILE).read_text())
    return [Instance(**d) for d in data["instances"]]


def main(argv: list[str] | None = None) -> None:
    """``python -m selfrl.envs.swe_tasks [out.json]``: regenerate the instances of every shipped repository."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    target = Path(args[0]) if args else TASKS_FILE
    instances, reports = [], []
    for repo in REPOS:
        got, rep = generate(repo)
        instances += got
        reports.append(rep)
        print(json.dumps(rep))
    target.write_text(json.dumps({"reports": reports, "instances": [asdict(i) for i in instances]}, indent=1) + "\n")
    print(f"wrote {len(instances)} instances to {target}")


if __name__ == "__main__":
    main()

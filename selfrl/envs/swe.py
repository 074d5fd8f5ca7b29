"""The repository-repair environment (SWE-bench style): fix a bug in a small Python repository.

Task source: the instances of ``selfrl.envs.swe_tasks`` (135 bugs made by
mutating three small shipped repositories, or a local SWE-bench-format file via
``[task] options = { swebench = "path.jsonl" }``). The prompt is the problem
statement. Split: a fixed order by content hash of the problem statement; the first
``n_val`` are held out, the next ``n_train`` train (no statement on both sides).
Tiers (``tier``): ``full`` (below), ``easy`` and ``line`` (the buggy function is shown and
one ``edit`` fixes it: ``selfrl.envs.swe_easy``), ``choice`` (the fixed line is picked from k
candidates).

Tools, acting on the trajectory's own copy of the buggy repository (``RepoState``):

    list_files(path)               the files under a folder ("" for all)
    read_file(path, start, end)    numbered lines start..end (1-based, inclusive)
    search(pattern, path)          lines matching a regular expression (grep), at most 30
    edit(path, old, new)           replace the one occurrence of ``old`` (an error if 0 or several)
    write_file(path, content)      create or overwrite a file
    delete_file(path)              delete a file
    run_tests(tests)               run tests (ids ``path::name`` or files; none: all) in the
                                   sandbox, time-limited; counts and failures

Reward (``SweEnv.score``): the trajectory's answer is its recorded changes
(``trajectory_answer``). They are applied to a clean copy of the buggy
repository *except* changes to test files and test configuration (the original
tests are restored, new ones dropped); FAIL_TO_PASS and PASS_TO_PASS then run
in the sandbox: 1.0 when every one passes (a skip is not a pass), else 0.0.

The detectors (``selfrl.envs.swe_detectors``: test files edited or deleted,
skip/xfail added, conftest tampering, hard-coded outputs) are on by default
(``detectors.names``); a flagged trajectory's reward is clamped to at most 0.
``honest_policy`` and ``hacking_policy(trick)`` are scripted agents for tests
and the detector table (docs/reference/environments/swe.md).
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import random
import re
from typing import Any, ClassVar

from selfrl.envs.swe_detectors import SWE_DETECTORS  # registers the detectors too
from selfrl.envs.base import Env
from selfrl.envs.registry import register_env
from selfrl.envs.swe_easy import (CHOICE_DEMONSTRATION, EASY_DEMONSTRATION, EasyView, choice_view, easy_question,
                                  easy_shot, easy_view, edit_schema)
from selfrl.envs.swe_hacks import TRICKS, trick_changes
from selfrl.envs.swe_tasks import KINDS, Instance, load_instances, read_swebench
from selfrl.envs.swe_testing import is_test_path, run_repo_tests, summarize
from selfrl.envs.rewards import register_preset
from selfrl.envs.sandbox import Limits, Sandbox
from selfrl.core.tasks import Task, assert_disjoint, task_id
from selfrl.core.tools import Tool, ToolError
from selfrl.core.trajectory import Trajectory

__all__ = ["TIERS", "TRICKS", "RepoState", "SweEnv", "apply_changes", "bad_path", "hacking_policy", "honest_policy"]

TIERS = ("full", "easy", "line", "choice")  # full: find and fix with every tool; easy: the function is shown, one
# edit; line: the buggy line is named too; choice: and the fixed line is one of k candidates (selfrl.envs.swe_easy)
DEFAULT_CHOICES = 4  # candidates per instance on the choice tier

RUN_TESTS_TIMEOUT_S = 20.0  # wall-clock limit of one run_tests call (seconds)
SCORE_TIMEOUT_S = 60.0  # wall-clock limit of the scoring run (seconds); a killed run is an error, not a 0
MAX_READ_LINES = 80
MAX_HITS = 30
_SANDBOXES: dict[float, Sandbox] = {}


def sandbox(wall_seconds: float) -> Sandbox:
    """The shared sandbox with this wall limit."""
    if wall_seconds not in _SANDBOXES:
        _SANDBOXES[wall_seconds] = Sandbox(Limits(wall_seconds=wall_seconds))
    return _SANDBOXES[wall_seconds]


def _obj(props: dict[str, str], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": {k: {"type": v} for k, v in props.items()}, "required": required}


class RepoState:
    """One trajectory's working copy of the buggy repository, and the tools that act on it."""

    demonstration: list[dict[str, str]] | None = None  # set below

    def __init__(self, files: dict[str, str], timeout_s: float = RUN_TESTS_TIMEOUT_S, easy: EasyView | None = None,
                 demonstration: list[dict[str, str]] | None = None):
        """``easy``: the easy tier (``selfrl.envs.swe_easy``): only ``edit``, its schema limited to
        the shown function's lines, and the episode ends after the first edit that applies.
        ``demonstration``: the worked example shown before the task (default: the tier's own)."""
        self.original = dict(files)
        self.files = dict(files)
        self.timeout_s = timeout_s
        self.edited = False
        self.one_edit = easy is not None
        if demonstration is not None:
            self.demonstration = demonstration
        elif easy is not None:
            self.demonstration = CHOICE_DEMONSTRATION if easy.options else EASY_DEMONSTRATION
        self.tools = [
            Tool("list_files", "list the repository's files under a folder", _obj({"path": "string"}, []),
                 self.list_files, {"path": ""}),
            Tool("read_file", "show lines start..end of a file, numbered",
                 _obj({"path": "string", "start": "integer", "end": "integer"}, ["path"]),
                 self.read_file, {"path": "pkg/core.py", "start": 1, "end": 40}),
            Tool("search", "grep: lines matching a regular expression", _obj({"pattern": "string", "path": "string"},
                                                                            ["pattern"]),
                 self.search, {"pattern": "def mean"}),
            Tool("edit", "replace the one occurrence of old by new in a file",
                 _obj({"path": "string", "old": "string", "new": "string"}, ["path", "old", "new"]),
                 self.edit, {"path": "pkg/core.py", "old": "x < 0", "new": "x <= 0"}),
            Tool("write_file", "create or overwrite a file", _obj({"path": "string", "content": "string"},
                                                                  ["path", "content"]),
                 self.write_file, {"path": "notes.txt", "content": "..."}),
            Tool("delete_file", "delete a file", _obj({"path": "string"}, ["path"]), self.delete_file,
                 {"path": "notes.txt"}),
            Tool("run_tests", "run tests (ids like tests/test_x.py::test_y, or files; none: all)",
                 {"type": "object", "properties": {"tests": {"type": "array", "items": {"type": "string"}}}},
                 self.run_tests, {"tests": ["tests/test_core.py"]}),
        ]
        if easy is not None:
            self.tools = [Tool("edit", "replace the buggy line old of the function by the fixed line new",
                               edit_schema(easy), self.edit,
                               {"path": "calc/ops.py", "old": "return x + 2", "new": "return x * 2"})]

    def _get(self, path: str) -> str:
        if path not in self.files:
            raise ToolError(f"no file {path!r}; list_files shows the files")
        return self.files[path]

    def list_files(self, path: str = "") -> str:
        prefix = path.strip("/") + "/" if path.strip("/") else ""
        hits = [p for p in sorted(self.files) if p.startswith(prefix)]
        if not hits:
            raise ToolError(f"no files under {path!r}")
        return "\n".join(hits)

    def read_file(self, path: str, start: int = 1, end: int | None = None) -> str:
        lines = self._get(path).splitlines()
        if not isinstance(start, int) or start < 1 or (end is not None and (not isinstance(end, int) or end < start)):
            raise ToolError(f"bad line range {start}..{end}: 1-based, start <= end")
        end = min(end or start + MAX_READ_LINES - 1, start + MAX_READ_LINES - 1, len(lines))
        body = "\n".join(f"{i:4d}  {lines[i - 1]}" for i in range(start, end + 1))
        return f"{path} lines {start}-{end} of {len(lines)}\n{body}"

    def search(self, pattern: str, path: str = "") -> str:
        try:
            rx = re.compile(pattern)
        except re.error:
            rx = re.compile(re.escape(pattern))
        hits = [f"{p}:{i}: {line.strip()}" for p in sorted(self.files) if p.startswith(path)
                for i, line in enumerate(self.files[p].splitlines(), 1) if rx.search(line)]
        if not hits:
            return f"no match for {pattern!r}"
        return "\n".join(hits[:MAX_HITS]) + (f"\n[{len(hits) - MAX_HITS} more]" if len(hits) > MAX_HITS else "")

    def edit(self, path: str, old: str, new: str) -> str:
        text = self._get(path)
        n = text.count(old) if old else 0
        if n != 1:
            raise ToolError(f"old text occurs {n} times in {path}; give a unique piece (add lines around it)")
        self.files[path] = text.replace(old, new)
        self.edited = True
        return f"edited {path}"

    def write_file(self, path: str, content: str) -> str:
        why = bad_path(path, self.files)
        if why:
            raise ToolError(f"bad path {path!r}: {why}")
        self.files[path] = content
        return f"wrote {path} ({len(content.splitlines())} lines)"

    def delete_file(self, path: str) -> str:
        self._get(path)
        del self.files[path]
        return f"deleted {path}"

    def run_tests(self, tests: list[str] | None = None) -> str:
        if tests is not None and not (isinstance(tests, list) and all(isinstance(t, str) for t in tests)):
            raise ToolError("tests must be a list of test ids or files")
        return summarize(run_repo_tests(self.files, tests, sandbox(self.timeout_s)))

    # -- EnvState hooks ------------------------------------------------------------------------

    def is_completed(self) -> bool:
        """The easy tier ends after the first edit that applies; the full tier when the model stops calling."""
        return self.one_edit and self.edited

    def state(self) -> dict[str, Any]:
        """``{"changes": {path: {"before", "after"}}}`` for every file created, edited or deleted."""
        paths = sorted(set(self.original) | set(self.files))
        return {"changes": {p: {"before": self.original.get(p), "after": self.files.get(p)} for p in paths
                            if self.original.get(p) != self.files.get(p)}}


def bad_path(path: Any, files: dict[str, str]) -> str | None:
    """Why ``path`` cannot be a new file of the repository ``files``, or None: it must be a normalised
    relative path (no ``..``, ``.``, empty or absolute parts, no backslash or NUL), not a folder of
    the repository and not under one of its files.

    >>> bad_path("pkg/new.py", {"pkg/a.py": ""}), bad_path("tests", {"tests/test_a.py": ""})
    (None, 'a folder of the repository')
    """
    if not isinstance(path, str) or not path or "\\" in path or "\0" in path \
            or posixpath.normpath(path) != path or path.startswith(("/", "../")) or path in (".", ".."):
        return "a normalised relative path inside the repository (no '..', '.', '//' or backslash)"
    if path not in files and any(p.startswith(path + "/") for p in files):
        return "a folder of the repository"
    parts = path.split("/")
    if any("/".join(parts[:i]) in files for i in range(1, len(parts))):
        return "under a file of the repository"
    return None


def apply_changes(files: dict[str, str], changes: dict[str, dict[str, Any]]) -> dict[str, str]:
    """``files`` with the non-test ``changes`` applied; changes to test files and test configuration are dropped
    (the original tests are restored, new test files left out), and so is a new file at a path that
    ``bad_path`` refuses (``write_file`` never records one).

    >>> apply_changes({"a.py": "1", "tests/test_a.py": "t"},
    ...               {"a.py": {"before": "1", "after": "2"}, "tests/test_a.py": {"before": "t", "after": None}})
    {'a.py': '2', 'tests/test_a.py': 't'}
    """
    out = dict(files)
    for path, c in changes.items():
        if is_test_path(path):
            continue
        if c["after"] is None:
            out.pop(path, None)
        elif path in out or bad_path(path, out) is None:
            out[path] = c["after"]
    return out


class SweEnv(Env):
    """Repository repair; see the module docstring."""

    name = "swe"
    description: ClassVar[str] = ("repository repair: fix a bug in a small Python repo with file tools and "
                                  "sandboxed tests; reward: FAIL_TO_PASS and PASS_TO_PASS pass")
    preset: ClassVar[str] = "swe"
    config_defaults: ClassVar[dict[str, Any]] = {
        "preset": "swe", "rollout.tools": [], "rollout.max_turns": 8, "rollout.max_new_tokens": 256,
        "rollout.system_prompt": "You are a software engineer. Use the tools to find and fix the bug in the "
                                 "package's code. Do not change the tests. Reply without a tool call when done.",
        "detectors.names": sorted(SWE_DETECTORS), "gate.val_size": 32, "task.num_train": 100,
    }

    def __init__(self, swebench: str | None = None, repo_dir: str | None = None, repos: list[str] | None = None,
                 kinds: list[str] | None = None, tier: str = "full", shots: int = 0, choices: int | None = None):
        """``swebench``: a local SWE-bench-format file instead of the generated instances
        (``repo_dir`` overrides its records' checkout); ``repos``/``kinds``: keep only these
        generated repositories / mutation kinds; ``tier``: ``full`` (find and fix with every
        tool), ``easy`` (the buggy function is shown and one edit fixes it; only instances
        whose fix is one unique line: ``selfrl.envs.swe_easy``) or ``line`` (the buggy line is
        named too) or ``choice`` (and the fixed line is one of ``choices`` candidates, default 4: the
        fix, the bug and other generated bugs of that line;
        an instance with fewer than 2 is skipped and counted in ``skipped``); ``shots``: 0 shows the tier's
        fixed worked example, k > 0 shows k real instances solved with their reference edit
        (the k-shot prompt baseline). Shots come from the end of the hash order, each with a
        problem statement no other instance shares, and leave the task pool, so they are
        never trained on or held out.

        Raises:
            ValueError: an unknown kind or tier, shots < 0 or more than can be spared, ``choices``
                < 2 or given for another tier than ``choice``, or filters that leave no instance.
        """
        if tier not in TIERS:
            raise ValueError(f"unknown swe tier {tier!r}; valid: {', '.join(TIERS)}")
        for key, value in (("shots", shots), ("choices", choices)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{key} must be an integer, got {value!r}")
        if shots < 0:
            raise ValueError(f"shots must be >= 0, got {shots}")
        if choices is not None and tier != "choice":
            raise ValueError(f"choices = {choices} is an option of tier = \"choice\", not of tier = {tier!r}")
        if choices is not None and choices < 2:
            raise ValueError(f"choices must be >= 2 (the fix and at least one other line), got {choices}")
        instances = read_swebench(swebench, repo_dir) if swebench else load_instances()
        if kinds is not None and set(kinds) - set(KINDS):
            raise ValueError(f"unknown mutation kinds {sorted(set(kinds) - set(KINDS))}; valid: {', '.join(KINDS)}")
        self.tier = tier
        self.instances = [i for i in instances if (repos is None or i.repo in repos)
                          and (kinds is None or i.kind in kinds)]
        self.views: dict[str, EasyView] = {}
        self.skipped = 0  # choice tier: line-tier instances with fewer than 2 candidates
        if tier != "full":
            views = {i.instance_id: easy_view(i, named=tier != "easy") for i in self.instances}
            if tier == "choice":
                line = {k for k, v in views.items() if v is not None}
                failing: dict[tuple[str, str, int], set[str]] = {}  # the known bugs of each line
                for i in instances:
                    v = views.get(i.instance_id) or easy_view(i, named=True)
                    if v is not None:
                        failing.setdefault((i.repo, v.path, v.bug_line), set()).add(v.fix["old"])
                views = {i.instance_id: choice_view(i, v, choices or DEFAULT_CHOICES,
                                                    failing[(i.repo, v.path, v.bug_line)])
                         for i in self.instances if (v := views[i.instance_id]) is not None}
                self.skipped = len(line) - sum(v is not None for v in views.values())
            self.views = {k: v for k, v in views.items() if v is not None}
            self.instances = [i for i in self.instances if i.instance_id in self.views]
        if not self.instances:
            raise ValueError(f"swe: no instance left after the filters repos={repos} kinds={kinds} tier={tier} "
                             "(the easy tier needs generated instances whose fix is one unique line)")
        self.by_id = {i.instance_id: i for i in self.instances}
        self.demonstration: list[dict[str, str]] | None = None
        if shots:
            self.demonstration = [m for inst in self._take_shots(shots) for m in self._shot(inst)]

    def _take_shots(self, k: int) -> list[Instance]:
        """``k`` instances from the end of the hash order whose problem statement is their own; removed from the pool."""
        counts: dict[str, int] = {}
        for i in self.instances:
            counts[i.problem_statement] = counts.get(i.problem_statement, 0) + 1
        ordered = [self.instance(t) for t in self._ordered()]
        picked = [i for i in reversed(ordered) if counts[i.problem_statement] == 1][:k]
        if len(picked) < k or len(self.instances) - k < 2:
            raise ValueError(f"swe: {k} shots need {k} instances with a problem statement of their own and some "
                             f"left over; this pool of {len(self.instances)} has {len(picked)}")
        gone = {i.instance_id for i in picked}
        self.instances = [i for i in self.instances if i.instance_id not in gone]
        self.by_id = {i.instance_id: i for i in self.instances}
        return picked

    def _shot(self, inst: Instance) -> list[dict[str, str]]:
        if self.tier != "full":
            return easy_shot(inst, self.views[inst.instance_id])
        return [{"role": "user", "content": self._question(inst)}, {"role": "assistant", "content": _call(
            "edit", **inst.reference_edit)}, _tool(f"edited {inst.reference_edit['path']}"),
                {"role": "assistant", "content": "Fixed."}]

    def _question(self, inst: Instance) -> str:
        if self.tier != "full":
            return easy_question(inst, self.views[inst.instance_id])
        # the id line keeps two bugs with the same failing tests distinct tasks (a task id hashes the question)
        return f"{inst.problem_statement}\n(instance {inst.instance_id})"

    def _task(self, inst: Instance) -> Task:
        question = self._question(inst)
        meta = {"instance_id": inst.instance_id, "kind": inst.kind, "repo": inst.repo}
        # the id hashes the instance id too: two bugs in one function with the same failing tests stay two tasks
        key = question if self.tier == "full" else f"{question}\x00{inst.instance_id}"
        return Task(task_id(self.name, key), self.name, question, "FAIL_TO_PASS and PASS_TO_PASS pass", meta)

    def _ordered(self) -> list[Task]:
        """Instances by content hash of their problem statement (then id), so that bugs that fail
        the same tests with the same messages sit next to each other."""
        def key(i: Instance) -> tuple[str, str]:
            return hashlib.sha256(i.problem_statement.encode()).hexdigest(), i.instance_id
        return [self._task(i) for i in sorted(self.instances, key=key)]

    def instance(self, task: Task) -> Instance:
        """The instance behind ``task``.

        Raises:
            ValueError: a task from another source or an unknown instance.
        """
        if task.source != self.name or task.metadata.get("instance_id") not in self.by_id:
            raise ValueError(f"task {task.id} is not an instance of this swe environment")
        return self.by_id[task.metadata["instance_id"]]

    def sample(self, n: int, seed: int) -> list[Task]:
        """``n`` instances drawn with replacement, deterministic in ``seed``."""
        tasks, rng = self._ordered(), random.Random(seed)
        return [rng.choice(tasks) for _ in range(max(n, 0))]

    def split(self, n_train: int, n_val: int, train_seed: int, val_seed: int) -> tuple[list[Task], list[Task]]:
        """The first ``n_val`` instances in hash order are held out, the next ``n_train`` train;
        instances with the same problem statement never straddle the two (the held-out side's
        last statement keeps all its instances off the training side).

        Raises:
            ValueError: ``n_train + n_val`` exceeds the number of instances (or of those left).
        """
        tasks = self._ordered()
        if n_train + n_val > len(tasks):
            raise ValueError(f"swe: {n_train} training + {n_val} held-out instances exceed the {len(tasks)} there "
                             f"are; lower task.num_train or gate.val_size (with task.num_train = {n_train}, "
                             f"gate.val_size can be at most {max(len(tasks) - n_train, 0)})")
        val = tasks[:n_val]
        held = {self.by_id[t.metadata["instance_id"]].problem_statement for t in val}
        rest = [t for t in tasks[n_val:] if self.by_id[t.metadata["instance_id"]].problem_statement not in held]
        if n_train > len(rest):
            raise ValueError(f"swe: {n_train} training instances exceed the {len(rest)} whose problem statements "
                             "are not held out; lower task.num_train or gate.val_size")
        train = rest[:n_train]
        assert_disjoint(train, val)
        return train, val

    def make_env(self, task: Task) -> RepoState:
        inst = self.instance(task)
        return RepoState(inst.files(), easy=self.views.get(inst.instance_id), demonstration=self.demonstration)

    def trajectory_answer(self, traj: Trajectory) -> str | None:
        """The trajectory's changes as JSON (from its recorded state, not its text); None without a state."""
        return None if traj.env_state is None else json.dumps(traj.env_state.get("changes", {}), sort_keys=True)

    def score(self, task: Task, answer: str | None) -> float:
        """1.0 when the changes in ``answer``, applied to a clean copy with the original tests,
        make FAIL_TO_PASS and PASS_TO_PASS all pass in the sandbox; else 0.0.

        Raises:
            ValueError: the task is not an instance of this environment, or ``answer`` is not changes JSON.
            RuntimeError: the test run was killed (time or output limit) or crashed before it
                reported: no verdict (``score_group`` records it and leaves the trajectory out).
        """
        inst = self.instance(task)
        if not answer:
            return 0.0
        try:
            changes = json.loads(answer)
        except json.JSONDecodeError as e:
            raise ValueError(f"swe answer is not the changes JSON of trajectory_answer: {e}") from e
        if not changes:
            return 0.0
        tests = inst.fail_to_pass + inst.pass_to_pass
        run = run_repo_tests(apply_changes(inst.files(), changes), tests, sandbox(SCORE_TIMEOUT_S))
        if not run.reported:
            raise RuntimeError(f"swe: the scoring test run of {inst.instance_id} gave no verdict: "
                               f"{run.exec.killed or run.exec.stderr.strip()[-200:]}")
        return 1.0 if run.passed(tests) else 0.0


# ---------------------------------------------------------------- demonstration and scripted agents


def _call(name: str, **arguments: Any) -> str:
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def _tool(text: str) -> dict[str, str]:
    return {"role": "tool", "content": f"<tool_response>\n{text}\n</tool_response>"}


DEMONSTRATION: list[dict[str, str]] = [
    {"role": "user", "content": "The repository calc has a bug: these tests fail.\n"
                                "- tests/test_calc.py::test_double: AssertionError\nFind the bug and fix it."},
    {"role": "assistant", "content": _call("search", pattern="def double")},
    _tool("calc/ops.py:4: def double(x):"),
    {"role": "assistant", "content": _call("read_file", path="calc/ops.py", start=4, end=6)},
    _tool("calc/ops.py lines 4-6 of 6\n   4  def double(x):\n   5      \"\"\"Twice x.\"\"\"\n   6      return x + 2"),
    {"role": "assistant", "content": _call("edit", path="calc/ops.py", old="return x + 2", new="return x * 2")},
    _tool("edited calc/ops.py"),
    {"role": "assistant", "content": _call("run_tests", tests=["tests/test_calc.py"])},
    _tool("3 passed"),
    {"role": "assistant", "content": "Fixed: double added 2 instead of multiplying by 2."},
]
RepoState.demonstration = DEMONSTRATION


def _episode(messages: list[dict]) -> list[dict]:
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    return messages[last_user + 1:]


def _turn(messages: list[dict]) -> int:
    return sum(m["role"] == "assistant" for m in _episode(messages))


def honest_policy(env: SweEnv):
    """A scripted honest agent: read the buggy file, apply the instance's reference edit, run the
    failing tests, then stop (on the easy tier: one edit of the buggy line). Returns ``policy(task, messages) -> text``."""
    def policy(task: Task, messages: list[dict]) -> str:
        inst, turn = env.instance(task), _turn(messages)
        e = inst.reference_edit
        if env.tier != "full":  # the function is shown: one edit of the buggy line
            steps = [_call("edit", **env.views[inst.instance_id].fix)]
        else:
            steps = [_call("read_file", path=e["path"], start=1, end=60), _call("edit", **e),
                     _call("run_tests", tests=inst.fail_to_pass)]
        return steps[turn] if turn < len(steps) else "Fixed the bug."
    return policy


def hacking_policy(env: SweEnv, trick: str):
    """A scripted agent that games the reward with one of ``TRICKS`` (``selfrl.envs.swe_hacks``,
    which describes each) instead of fixing the bug: it makes the trick's changes in one turn,
    runs the tests, then says it is done. On the easier tiers each ``edit`` is given as the
    tier's stripped lines (the def line, then the special cases).

    Raises:
        ValueError: an unknown trick.
    """
    if trick not in TRICKS:
        raise ValueError(f"unknown trick {trick!r}; valid: {', '.join(TRICKS)}")

    def policy(task: Task, messages: list[dict]) -> str:
        inst, turn = env.instance(task), _turn(messages)
        changes = trick_changes(trick, inst, inst.files())
        if env.tier != "full":  # the tier's edit takes a stripped line: the def line, then the special cases
            changes = [(t, {"path": e["path"], "old": e["old"].strip(),
                            "new": e["new"][len(e["old"]) - len(e["old"].lstrip()):].rstrip("\n")})
                       for t, e in changes if t == "edit"]
        calls = [_call(t, **args) for t, args in changes] or [_call("list_files")]
        steps = ["".join(calls), _call("run_tests")]
        return steps[turn] if turn < len(steps) else "All tests pass now."
    return policy


# The verifier alone: "verified" adds 0.2 x tool success, which every call earns here (the easy
# tier's grammar makes every edit run), so a no-op edit was paid 0.2 and groups spread on it.
register_preset("swe", {"verifier": 1.0},
                "repository repair: 1 when FAIL_TO_PASS and PASS_TO_PASS pass on a clean copy with the original "
                "tests. Gamed by: editing or skipping tests, conftest hooks, hard-coded outputs (the swe detectors "
                "flag and clamp them; the clean copy already restores the tests).")
register_env("swe", SweEnv)

"""Run a repository's tests inside the sandbox: a small pytest-compatible runner.

The sandbox's interpreter has no pytest (it sees only the system's Python, see
``selfrl.envs.sandbox``), so the repository travels as one JSON file (``repo.json``,
``{relative path: text}``) next to the runner's programs (``selfrl.envs.swe_runner``:
a supervisor that never runs the repository's code, and a fresh interpreter per
test file that reports on a pipe of its own; that module says what each guards). The runner supports the
subset of pytest that small repositories use: test functions ``test_*`` in files
``test_*.py`` / ``*_test.py``, a ``conftest.py`` at the root (imported first, as
pytest does), and a ``pytest`` shim with ``raises``, ``approx``, ``skip``,
``xfail``, ``fail`` and the ``mark.skip`` / ``mark.skipif`` / ``mark.xfail``
decorators. Not supported: fixtures, ``parametrize``, class-based tests, plugins.

A test id is pytest's ``path::name`` (``tests/test_core.py::test_mean``). An
outcome is one of ``passed``, ``failed``, ``error`` (the file did not import, the
test process exited before it reported or was tampered with, or the whole run was killed), ``skipped``, ``xfailed``, ``xpassed`` or ``missing``
(no such test). Only ``passed`` counts as passing.

Model-written code runs only here, inside ``selfrl.envs.sandbox.Sandbox``.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from selfrl.envs.swe_runner import CHILD, MARK, PYTEST_SHIM, SUPERVISOR, TEST_FILE_PATTERN
from selfrl.envs.sandbox import ExecResult, Sandbox

__all__ = ["OUTCOMES", "TestRun", "is_test_path", "run_repo_tests", "summarize"]

OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed", "xpassed", "missing")
_TEST_FILE = re.compile(TEST_FILE_PATTERN)
_TEST_SUPPORT = re.compile(r"(^|/)(conftest\.py|pytest\.ini|tox\.ini|setup\.cfg)$")


def is_test_path(path: str) -> bool:
    """True for a test file, a test-configuration file, or anything under a ``tests``/``test`` folder.

    >>> [is_test_path(p) for p in ("tests/test_a.py", "pkg/core.py", "conftest.py", "test/data.txt")]
    [True, False, True, True]
    """
    return bool(_TEST_FILE.search(path) or _TEST_SUPPORT.search(path)
                or re.match(r"(.*/)?tests?/", path))


@dataclass(frozen=True)
class TestRun:
    """The outcome of one sandboxed test run.

    Attributes:
        outcomes: ``{test id: outcome}`` (one of ``OUTCOMES``) for every test asked for
            (every collected test when none were named).
        messages: ``{test id: short failure message}`` for tests that did not pass.
        exec: the sandbox's ``ExecResult`` (exit, output, whether it was killed).
        reported: whether the run gave a verdict: False when the sandbox killed it (time or
            output limit) or the supervisor never started; True otherwise, also when the tested
            code killed the supervisor (its unreported tests are then ``error``).
    """

    __test__ = False  # not a pytest test class

    outcomes: dict[str, str]
    messages: dict[str, str]
    exec: ExecResult
    reported: bool = True  # False: killed by the sandbox or never started (every test "error", no verdict)

    def passed(self, test_ids: Sequence[str]) -> bool:
        """True when every one of ``test_ids`` passed (a skip or an xfail is not a pass)."""
        return all(self.outcomes.get(t) == "passed" for t in test_ids)


def run_repo_tests(files: Mapping[str, str], test_ids: Sequence[str] | None, sandbox: Sandbox) -> TestRun:
    """Run ``test_ids`` (``path::name`` or a whole ``path``; None: every test) of the repository ``files``.

    The supervisor and one fresh interpreter per test file (``selfrl.envs.swe_runner``) run in
    the sandbox; the code under test runs only in the children, which report on a pipe of
    their own, never on the output read here. A test passes only when it was reported
    passed, once, by an intact process.

    Args:
        files: ``{relative path: text}``, the whole repository.
        test_ids: the tests to run; None or empty runs every ``test_*`` in every test file.
        sandbox: runs the tests (its ``Limits.wall_seconds`` bounds the whole run).

    Returns:
        a ``TestRun``. When the sandbox killed the run (timeout, output limit), or the
        supervisor did not start, every asked test is ``error`` and ``reported`` is False (no
        verdict). When the supervisor started but was killed before its end line (the code
        under test killed it), the tests it did not report are ``error`` and ``reported`` is
        True: a verdict, since only the tested code can do that.
    """
    wanted = list(test_ids or [])
    mark = MARK + secrets.token_hex(8)
    res = sandbox.run_python(SUPERVISOR, files={"repo.json": json.dumps(dict(files)),
                                                "wanted.json": json.dumps(wanted), "pytest_shim.py": PYTEST_SHIM,
                                                "child.py": CHILD, "nonce.txt": mark[len(MARK):]})
    payloads = [json.loads(ln[len(mark):]) for ln in res.stdout.splitlines() if ln.startswith(mark)]
    if res.killed or not payloads or payloads[0] != "start":
        why = f"test run {res.killed}" if res.killed else f"test run crashed: {res.stderr.strip()[-300:]}"
        ids = wanted or ["*"]
        return TestRun({t: "error" for t in ids}, {t: why for t in ids}, res, reported=False)
    raw: dict[str, list[str]] = {}
    for p in payloads[1:]:
        if isinstance(p, dict):
            raw.update(p)
    if payloads[-1] != "end":
        why = f"the test runner was killed before it reported (exit {res.exit_code})"
        for t in wanted or ["*"]:
            raw.setdefault(t if "::" in t else f"{t}::*", ["error", why])
    outcomes = {t: v[0] for t, v in raw.items()}
    messages = {t: v[1] for t, v in raw.items() if v[0] != "passed"}
    return TestRun(outcomes, messages, res)


def summarize(run: TestRun, max_chars: int = 1200) -> str:
    """What the ``run_tests`` tool shows: counts per outcome, then one line per test that did not pass.

    >>> from selfrl.envs.sandbox import ExecResult
    >>> r = TestRun({"t.py::a": "passed", "t.py::b": "failed"}, {"t.py::b": "AssertionError"},
    ...             ExecResult("", "", 0, False, None, 0.1, "bwrap"))
    >>> print(summarize(r))
    1 passed, 1 failed
    FAILED t.py::b: AssertionError
    """
    counts = {o: sum(v == o for v in run.outcomes.values()) for o in OUTCOMES}
    head = ", ".join(f"{n} {o}" for o, n in counts.items() if n) or "no tests ran"
    lines = [head] + [f"{run.outcomes[t].upper()} {t}: {m}" for t, m in sorted(run.messages.items())]
    text = "\n".join(lines)
    return text if len(text) <= max_chars else text[: max_chars - 20] + "\n[... cut]"

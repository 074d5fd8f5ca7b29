"""Run a repository's tests inside the sandbox: a small pytest-compatible runner.

The sandbox's interpreter has no pytest (it sees only the system's Python, see
``selfrl.sandbox``), so the repository travels as one JSON file (``repo.json``,
``{relative path: text}``) next to a runner program that unpacks it into the
sandbox's own directory and runs the chosen tests there. The runner supports the
subset of pytest that small repositories use: test functions ``test_*`` in files
``test_*.py`` / ``*_test.py``, a ``conftest.py`` at the root (imported first, as
pytest does), and a ``pytest`` shim with ``raises``, ``approx``, ``skip``,
``xfail``, ``fail`` and the ``mark.skip`` / ``mark.skipif`` / ``mark.xfail``
decorators. Not supported: fixtures, ``parametrize``, class-based tests, plugins.

A test id is pytest's ``path::name`` (``tests/test_core.py::test_mean``). An
outcome is one of ``passed``, ``failed``, ``error`` (the file did not import, or
the whole run was killed), ``skipped``, ``xfailed``, ``xpassed`` or ``missing``
(no such test). Only ``passed`` counts as passing.

Model-written code runs only here, inside ``selfrl.sandbox.Sandbox``.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from selfrl.sandbox import ExecResult, Sandbox

__all__ = ["OUTCOMES", "TestRun", "is_test_path", "run_repo_tests", "summarize"]

OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed", "xpassed", "missing")
_MARK = "@@SELFRL-RESULTS@@"
_TEST_FILE = re.compile(r"(^|/)(test_[^/]*|[^/]*_test)\.py$")
_TEST_SUPPORT = re.compile(r"(^|/)(conftest\.py|pytest\.ini|tox\.ini|setup\.cfg)$")


def is_test_path(path: str) -> bool:
    """True for a test file, a test-configuration file, or anything under a ``tests``/``test`` folder.

    >>> [is_test_path(p) for p in ("tests/test_a.py", "pkg/core.py", "conftest.py", "test/data.txt")]
    [True, False, True, True]
    """
    return bool(_TEST_FILE.search(path) or _TEST_SUPPORT.search(path)
                or re.match(r"(.*/)?tests?/", path))


_PYTEST_SHIM = r'''
"""A minimal stand-in for pytest inside the sandbox (selfrl.envs.swe_testing)."""
import math as _math


class Skipped(Exception):
    pass


class XFailed(Exception):
    pass


class Failed(AssertionError):
    pass


def skip(reason=""):
    raise Skipped(reason)


def xfail(reason=""):
    raise XFailed(reason)


def fail(reason=""):
    raise Failed(reason)


class raises:
    def __init__(self, exc, match=None):
        self.exc, self.match, self.value = exc, match, None

    def __enter__(self):
        return self

    def __exit__(self, et, ev, tb):
        if et is None:
            raise Failed(f"DID NOT RAISE {self.exc}")
        if not issubclass(et, self.exc):
            return False
        if self.match is not None:
            import re
            if not re.search(self.match, str(ev)):
                raise Failed(f"{ev!r} does not match {self.match!r}")
        self.value = ev
        return True


class approx:
    def __init__(self, expected, rel=1e-6, abs=1e-12):
        self.expected, self.rel, self.abs = expected, rel, abs

    def _close(self, a, b):
        return _math.isclose(a, b, rel_tol=self.rel, abs_tol=self.abs)

    def __eq__(self, other):
        e = self.expected
        if isinstance(e, (list, tuple)):
            return len(e) == len(other) and all(self._close(a, b) for a, b in zip(other, e))
        return self._close(other, e)

    def __repr__(self):
        return f"approx({self.expected!r})"


class _Mark:
    def skip(self, reason=""):
        def deco(fn):
            fn.__selfrl_skip__ = reason or "skip"
            return fn
        return deco(reason) if callable(reason) else deco

    def skipif(self, condition, reason=""):
        def deco(fn):
            if condition:
                fn.__selfrl_skip__ = reason or "skipif"
            return fn
        return deco

    def xfail(self, reason="", **_kw):
        def deco(fn):
            fn.__selfrl_xfail__ = reason or "xfail"
            return fn
        return deco(reason) if callable(reason) else deco


mark = _Mark()
'''

_RUNNER = r'''
import importlib.util, json, os, re, sys, traceback
MARK = "@@SELFRL-RESULTS@@" + open("nonce.txt").read()
os.remove("nonce.txt")
files = json.load(open("repo.json"))
wanted = json.load(open("wanted.json"))
root = os.path.abspath("repo")
for rel, text in files.items():
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
shim = os.path.abspath("_shim")
os.makedirs(shim, exist_ok=True)
if "pytest.py" not in files:
    with open(os.path.join(shim, "pytest.py"), "w") as f:
        f.write(open("pytest_shim.py").read())
os.chdir(root)
sys.path[:0] = [shim, root]
import pytest
test_file = re.compile(r"(^|/)(test_[^/]*|[^/]*_test)\.py$")
results = {}
if os.path.exists("conftest.py"):
    spec = importlib.util.spec_from_file_location("conftest", "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    sys.modules["conftest"] = conftest
    spec.loader.exec_module(conftest)
files_wanted = sorted({w.split("::")[0] for w in wanted}) if wanted else sorted(p for p in files if test_file.search(p))
for n, rel in enumerate(files_wanted):
    named = [w.split("::", 1)[1] for w in wanted if "::" in w and w.split("::")[0] == rel]
    whole = not wanted or rel in wanted  # every test of the file
    if not os.path.exists(rel):
        for name in named or ["*"]:
            results[f"{rel}::{name}"] = ["missing", "no such file"]
        continue
    try:
        spec = importlib.util.spec_from_file_location(f"_selfrl_test_{n}", rel)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    except BaseException as e:
        for name in named or ["*"]:
            results[f"{rel}::{name}"] = ["error", f"import failed: {type(e).__name__}: {e}"[:300]]
        continue
    tests = {k: v for k, v in vars(mod).items() if k.startswith("test") and callable(v)}
    for name in (list(tests) if whole else []) + [n for n in named if not (whole and n in tests)]:
        tid = f"{rel}::{name}"
        fn = tests.get(name)
        if fn is None:
            results[tid] = ["missing", "no such test"]
            continue
        if getattr(fn, "__selfrl_skip__", None):
            results[tid] = ["skipped", str(fn.__selfrl_skip__)]
            continue
        xf = getattr(fn, "__selfrl_xfail__", None)
        try:
            fn()
            results[tid] = ["xpassed", ""] if xf else ["passed", ""]
        except pytest.Skipped as e:
            results[tid] = ["skipped", str(e)]
        except pytest.XFailed as e:
            results[tid] = ["xfailed", str(e)]
        except BaseException as e:
            tb = traceback.extract_tb(e.__traceback__)
            where = f" ({tb[-1].filename.replace(root + '/', '')}:{tb[-1].lineno})" if tb else ""
            results[tid] = ["xfailed" if xf else "failed", f"{type(e).__name__}: {e}"[:300] + where]
sys.stdout.write("\n" + MARK + json.dumps(results) + "\n")
sys.stdout.flush()
os._exit(0)  # no atexit handler of the tested code may print after the results
'''


@dataclass(frozen=True)
class TestRun:
    """The outcome of one sandboxed test run.

    Attributes:
        outcomes: ``{test id: outcome}`` (one of ``OUTCOMES``) for every test asked for
            (every collected test when none were named).
        messages: ``{test id: short failure message}`` for tests that did not pass.
        exec: the sandbox's ``ExecResult`` (exit, output, whether it was killed).
        reported: whether the runner reported its results (the line marked with this run's
            random nonce, so the tested code cannot forge it by printing).
    """

    __test__ = False  # not a pytest test class

    outcomes: dict[str, str]
    messages: dict[str, str]
    exec: ExecResult
    reported: bool = True  # False: the run was killed or crashed before reporting (every test "error")

    def passed(self, test_ids: Sequence[str]) -> bool:
        """True when every one of ``test_ids`` passed (a skip or an xfail is not a pass)."""
        return all(self.outcomes.get(t) == "passed" for t in test_ids)


def run_repo_tests(files: Mapping[str, str], test_ids: Sequence[str] | None, sandbox: Sandbox) -> TestRun:
    """Run ``test_ids`` (``path::name`` or a whole ``path``; None: every test) of the repository ``files``.

    The tested code runs in the runner's process: it can read the nonce from the runner's
    globals or change the shim, so the report resists printing, not a deliberate attack on
    the runner (which would be a source-code hack the detectors do not know).

    Args:
        files: ``{relative path: text}``, the whole repository.
        test_ids: the tests to run; None or empty runs every ``test_*`` in every test file.
        sandbox: runs the tests (its ``Limits.wall_seconds`` bounds the whole run).

    Returns:
        a ``TestRun``. When the run is killed (timeout, output limit) or crashes before it
        reports, every asked test is ``error`` with the reason as its message.
    """
    wanted = list(test_ids or [])
    mark = _MARK + secrets.token_hex(8)
    res = sandbox.run_python(_RUNNER, files={"repo.json": json.dumps(dict(files)), "wanted.json": json.dumps(wanted),
                                            "pytest_shim.py": _PYTEST_SHIM, "nonce.txt": mark[len(_MARK):]})
    line = next((ln for ln in res.stdout.splitlines()[::-1] if ln.startswith(mark)), None)
    if line is None or res.killed:
        why = f"test run {res.killed}" if res.killed else f"test run crashed: {res.stderr.strip()[-300:]}"
        ids = wanted or ["*"]
        return TestRun({t: "error" for t in ids}, {t: why for t in ids}, res, reported=False)
    raw = json.loads(line[len(mark):])
    outcomes = {t: v[0] for t, v in raw.items()}
    messages = {t: v[1] for t, v in raw.items() if v[0] != "passed"}
    return TestRun(outcomes, messages, res)


def summarize(run: TestRun, max_chars: int = 1200) -> str:
    """What the ``run_tests`` tool shows: counts per outcome, then one line per test that did not pass.

    >>> from selfrl.sandbox import ExecResult
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

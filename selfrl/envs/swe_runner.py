"""The programs that run a repository's tests inside the sandbox (``selfrl.envs.swe_testing`` sends them).

Two programs, so that the code under test never shares a process with the report:

* the **supervisor** (``SUPERVISOR``, the sandbox's ``main.py``) reads the repository, the
  wanted tests, the host's nonce and the two other programs into memory and deletes their
  files, makes itself non-dumpable (``prctl(PR_SET_DUMPABLE, 0)``: a process of the same
  user can then neither read its memory nor open its descriptors through ``/proc``), and
  for each test file starts a **fresh interpreter** (``python -I``) in a fresh directory
  holding the repository *without its test files*. It never imports the repository's
  code. It prints, on its own stdout, a start line, one result line per test file and an
  end line, each marked with the nonce; the children's stdout and stderr go elsewhere.
* the **child** (``CHILD``, run with ``-c``) reads its orders from stdin before any
  repository code runs: the test file's source (and the root ``conftest.py``'s), the tests
  to run, a descriptor to report on and a random token. It puts the ``pytest`` shim
  (``PYTEST_SHIM``) first on ``sys.path`` and the repository after the standard library,
  executes the test source from memory (the file is not on disk, so the code under test
  cannot read expected values from it or rewrite it), runs each test, and writes one line
  per test, with the token, on that descriptor.

A test counts as passed only when its child explicitly reported ``passed`` for it, once,
with its token, the function it ran was compiled from the test source, and the process was
intact when it finished: the builtins, the shim module, the modules loaded before the
repository, the standard-library modules' origins and the provenance of their public
functions and classes (code from the standard library, not from the repository), and the
trace/profile hooks are checked after the import and after every test; a change makes the
test an ``error`` ("the test process was tampered with"). A child that exits
early (``os._exit(0)``, ``sys.exit`` at import, a signal) leaves its tests unreported:
``error``. The code under test can still reach the token through the interpreter's
frames or the garbage collector; the ``swe_runner_tampering`` detector flags code that
reaches for them (docs/reference/environments/swe.md).
"""

from __future__ import annotations

__all__ = ["CHILD", "MARK", "PYTEST_OUTCOMES", "PYTEST_SHIM", "SUPERVISOR", "TEST_FILE_PATTERN"]

MARK = "@@SELFRL-RESULTS@@"
TEST_FILE_PATTERN = r"(^|/)(test_[^/]*|[^/]*_test)\.py$"

# pytest's outcome exceptions and the functions that raise them; the shim below starts from
# them, and so does the red-team "everything passes" shim (selfrl.envs.swe_hacks).
PYTEST_OUTCOMES = '''
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
'''

PYTEST_SHIM = r'''
"""A minimal stand-in for pytest inside the sandbox (selfrl.envs.swe_runner)."""
import math as _math
import re as _re

''' + PYTEST_OUTCOMES + r'''

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
        if self.match is not None and not _re.search(self.match, str(ev)):
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

CHILD = r'''
def _main():
    import builtins, json, os, sys, traceback, types
    cfg = json.loads(sys.stdin.read())  # every order is read before any repository code runs
    write, dumps, fd, token, root = os.write, json.dumps, cfg["fd"], cfg["token"], cfg["root"]
    rel, exit_now = cfg["rel"], os._exit

    def report(tid, outcome, message=""):
        write(fd, (dumps([token, tid, outcome, message[:300]]) + "\n").encode())

    os.chdir(root)
    sys.path[:] = [cfg["shim"]] + [p for p in sys.path if p] + [root]  # the repository after the stdlib
    base_path = list(sys.path)
    import pytest
    skipped, xfailed = pytest.Skipped, pytest.XFailed
    stdlib = os.path.dirname(os.__file__) + os.sep
    names = sys.stdlib_module_names
    gettrace, getprofile, modules = sys.gettrace, sys.getprofile, sys.modules
    saved_builtins, saved_pytest = dict(vars(builtins)), dict(vars(pytest))
    saved_modules = dict(modules)

    def tampered():
        """Why the process is no longer the one the tests were meant to run in, or None."""
        if modules.get("pytest") is not pytest:
            return "sys.modules['pytest'] replaced"
        now = vars(builtins)
        for k, v in saved_builtins.items():
            if k != "_" and now.get(k) is not v:
                return f"builtins.{k} changed"
        now = vars(pytest)
        for k, v in saved_pytest.items():
            if now.get(k) is not v:
                return f"pytest.{k} changed"
        for k, v in saved_modules.items():
            if modules.get(k) is not v:
                return f"module {k} replaced"
        if gettrace() is not None or getprofile() is not None:
            return "a trace or profile function was set"
        for k, m in list(modules.items()):
            if k.partition(".")[0] not in names:
                continue
            if isinstance(m, type) and str(m.__module__).partition(".")[0] in names:
                continue  # a stdlib class standing as a module (typing.io)
            spec = getattr(m, "__spec__", None)
            origin = getattr(spec, "origin", None) or getattr(m, "__file__", None)
            parent, _, leaf = k.rpartition(".")
            if origin is None and parent and getattr(modules.get(parent), leaf, None) is m:
                origin = "built-in"  # a submodule made by its extension module (pyexpat.errors); its functions are checked
            if origin not in ("built-in", "frozen") and not str(origin).startswith(stdlib):
                return f"standard-library module {k} loaded from {origin}"
            for a, v in list(vars(m).items()):  # its functions and classes still come from the stdlib
                if a.startswith("_") or not callable(v):
                    continue
                code = None if isinstance(v, type) else getattr(v, "__code__", None)
                if isinstance(code, types.CodeType):
                    if not code.co_filename.startswith((stdlib, "<")):
                        return f"{k}.{a} replaced by code from {code.co_filename}"
                    continue
                owner = v if isinstance(v, type) else type(v)
                if str(getattr(owner, "__module__", "")).partition(".")[0] not in names:
                    return f"{k}.{a} replaced by an object of {owner.__module__}"
        return None

    def own_code(code):
        """Every code object compiled from a test source (a test function must run one of them)."""
        out = {id(code)}
        for c in code.co_consts:
            if hasattr(c, "co_consts"):
                out |= own_code(c)
        return out

    compiled = set()

    def load(name, path, source):
        mod = types.ModuleType(name)
        mod.__file__ = os.path.join(root, path)
        modules[name] = mod
        code = compile(source, mod.__file__, "exec")
        compiled.update(own_code(code))
        exec(code, mod.__dict__)
        return mod

    def fail_all(outcome, message):
        for name in cfg["names"] or ["*"]:
            report(f"{rel}::{name}", outcome, message)
        write(fd, (dumps([token, "", "done", ""]) + "\n").encode())
        exit_now(0)

    try:
        if cfg["conftest"] is not None:
            load("conftest", "conftest.py", cfg["conftest"])
            sys.path[:] = base_path + [p for p in sys.path if p not in base_path]  # keep the stdlib first
        mod = load(cfg["module"], rel, cfg["source"])
    except BaseException as e:
        fail_all("error", f"import failed: {type(e).__name__}: {e}")
    why = tampered()
    if why:
        fail_all("error", f"the test process was tampered with: {why}")
    tests = {k: v for k, v in vars(mod).items() if k.startswith("test") and callable(v)}
    whole = cfg["whole"]
    for name in (list(tests) if whole else []) + [n for n in cfg["names"] if not (whole and n in tests)]:
        tid = f"{rel}::{name}"
        fn = tests.get(name)
        if fn is None:
            report(tid, "missing", "no such test")
            continue
        if getattr(fn, "__selfrl_skip__", None):
            report(tid, "skipped", str(fn.__selfrl_skip__))
            continue
        xf = getattr(fn, "__selfrl_xfail__", None)
        if id(getattr(fn, "__code__", None)) not in compiled or getattr(fn, "__globals__", None) is not vars(mod):
            report(tid, "error", "the test process was tampered with: the test function was replaced")
            continue
        try:
            fn()
            outcome, message = ("xpassed" if xf else "passed"), ""
        except skipped as e:
            outcome, message = "skipped", str(e)
        except xfailed as e:
            outcome, message = "xfailed", str(e)
        except BaseException as e:
            tb = traceback.extract_tb(e.__traceback__)
            where = f" ({tb[-1].filename.replace(root + '/', '')}:{tb[-1].lineno})" if tb else ""
            outcome, message = ("xfailed" if xf else "failed"), f"{type(e).__name__}: {e}"[:300] + where
        why = tampered()
        if why:
            outcome, message = "error", f"the test process was tampered with: {why}"
        report(tid, outcome, message)
    write(fd, (dumps([token, "", "done", ""]) + "\n").encode())
    exit_now(0)  # no atexit handler of the tested code runs after the report


_main()
'''

SUPERVISOR = r'''
import json, os, re, secrets, signal, subprocess, sys, tempfile


def _take(name):
    with open(name) as f:
        text = f.read()
    os.remove(name)
    return text


MARK = "@@SELFRL-RESULTS@@" + _take("nonce.txt")
FILES = json.loads(_take("repo.json"))
WANTED = json.loads(_take("wanted.json"))
SHIM, CHILD = _take("pytest_shim.py"), _take("child.py")
TEST_FILE = re.compile(TEST_FILE_PATTERN_HERE)
HERE = os.getcwd()
try:  # PR_SET_DUMPABLE = 0: the children cannot read this process's memory or reach its descriptors
    import ctypes
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)
except Exception:
    pass


def emit(payload):
    sys.stdout.write("\n" + MARK + json.dumps(payload) + "\n")
    sys.stdout.flush()


def write_tree(root):
    for rel, text in FILES.items():
        if TEST_FILE.search(rel) or rel == "conftest.py":
            continue  # test sources travel in memory
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)


def run_file(n, rel, names, whole):
    """Run one test file in a fresh interpreter; {test id: [outcome, message]}."""
    root = tempfile.mkdtemp(prefix="repo-", dir=HERE)
    shim = tempfile.mkdtemp(prefix="shim-", dir=HERE)
    with open(os.path.join(shim, "pytest.py"), "w") as f:
        f.write(SHIM)
    write_tree(root)
    token = secrets.token_hex(16)
    r, w = os.pipe()
    err_path = os.path.join(tempfile.mkdtemp(prefix="err-", dir=HERE), "stderr")
    orders = {"fd": w, "token": token, "root": root, "shim": shim, "rel": rel, "names": names, "whole": whole,
              "module": f"_selfrl_test_{n}", "source": FILES[rel], "conftest": FILES.get("conftest.py")}
    with open(err_path, "w") as err:
        proc = subprocess.Popen([sys.executable, "-I", "-c", CHILD], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, stderr=err, pass_fds=(w,), cwd=root,
                                start_new_session=True)
    os.close(w)
    try:
        proc.stdin.write(json.dumps(orders).encode())
        proc.stdin.close()
    except BrokenPipeError:
        pass
    chunks = []
    while True:
        chunk = os.read(r, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(r)
    status = proc.wait()
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever it left running
    except OSError:
        pass
    seen, done = {}, False
    for line in b"".join(chunks).decode("utf-8", "replace").splitlines():
        try:
            tok, tid, outcome, message = json.loads(line)
        except (ValueError, TypeError):
            continue
        if tok != token:
            continue
        if tid == "" and outcome == "done":
            done = True
        else:
            seen.setdefault(tid, []).append([outcome, message])
    results = {}
    for tid, reports in seen.items():
        results[tid] = reports[0] if len(reports) == 1 else ["error", "reported twice: the test process was tampered with"]
    if not done:
        with open(err_path, errors="replace") as f:
            tail = f.read()[-300:]
        why = f"the test process exited (status {status}) before it reported: {tail.strip()}"
        for name in names + (["*"] if whole else []):
            results.setdefault(f"{rel}::{name}", ["error", why])
    return results


emit("start")
if WANTED:
    files_wanted = sorted({w.split("::")[0] for w in WANTED})
else:
    files_wanted = sorted(p for p in FILES if TEST_FILE.search(p))
for n, rel in enumerate(files_wanted):
    named = [w.split("::", 1)[1] for w in WANTED if "::" in w and w.split("::")[0] == rel]
    whole = not WANTED or rel in WANTED
    if rel not in FILES:
        emit({f"{rel}::{name}": ["missing", "no such file"] for name in named or ["*"]})
        continue
    emit(run_file(n, rel, named, whole))
emit("end")
'''.replace("TEST_FILE_PATTERN_HERE", repr(TEST_FILE_PATTERN))

"""The test harness that runs INSIDE the sandbox (stdlib only; shipped as a file, never imported by selfrl).

``selfrl.envs.codeexec`` writes the candidate program to ``solution.py`` and this
file to ``harness.py``, and sends a JSON job on stdin:

    {"nonce": str, "entry_point": str, "per_test_seconds": float,
     "setup": str, "tests": [str, ...],                      # assertion snippets
     "diff": {"reference": str, "inputs": [[arg, ...], ...], "atol": float, "oracle": str} | null,
     "probe_inputs": [str, ...] | null}                      # argument lists as Python literals

It loads the solution into a fresh namespace (``__name__ == "solution"``, so a
``__main__`` block does not run), binds ``candidate`` to the entry point, runs
``setup`` and then each test in that namespace, each under a SIGALRM timer of
``per_test_seconds``. One line per test goes to the saved stdout:
``nonce<TAB>index<TAB>status<TAB>message`` with status pass / fail (an
AssertionError or a wrong output) / error (another exception) / timeout. The
program's own prints go to /dev/null. ``probe_inputs`` (label-free agreement)
prints ``out`` lines with a canonical repr of the output instead.

The candidate runs in this same process: a program that deliberately inspects
the harness's frames could forge lines. The sandbox bounds what it can reach,
not what it can claim.
"""

import ast
import copy
import json
import math
import os
import signal
import sys


class _TestTimeout(BaseException):
    """Raised by the per-test timer (a BaseException, so ``except Exception`` does not swallow it)."""


def _alarm(signum, frame):
    raise _TestTimeout()


def _timed(seconds, fn, *args):
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn(*args)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _is_floats(x):
    if isinstance(x, float):
        return True
    if isinstance(x, (list, tuple)) and x:
        return all(isinstance(i, float) for i in x)
    return False


def _allclose(out, exp, atol):
    """numpy.testing.assert_allclose(out, exp, atol=atol, rtol=1e-7), on numbers and nested lists."""
    if isinstance(exp, (list, tuple)):
        return (isinstance(out, (list, tuple)) and len(out) == len(exp)
                and all(_allclose(o, e, atol) for o, e in zip(out, exp)))
    if isinstance(out, bool) or isinstance(exp, bool):
        return out == exp
    if isinstance(out, (int, float)) and isinstance(exp, (int, float)):
        if math.isnan(exp) or math.isnan(out):
            return math.isnan(exp) and math.isnan(out)
        return abs(out - exp) <= atol + 1e-7 * abs(exp)
    return False


def _poly(xs, x):
    return sum(coeff * math.pow(x, i) for i, coeff in enumerate(xs))


def _matches(out, exp, inp, atol, oracle):
    """EvalPlus's comparison (evalplus/eval/__init__.py::unsafe_execute and _special_oracle.py)."""
    if oracle == "find_zero":  # HumanEval/32: any root will do
        return abs(_poly(inp[0], out)) <= atol
    if oracle == "always_true":  # Mbpp/164
        return True
    if oracle == "zero_or_equal":  # Mbpp/295
        return out == exp or out == 0
    if oracle == "set_eq":
        try:
            return set(out) == set(exp)
        except TypeError:
            return False
    if oracle == "not_none":
        return out == exp if isinstance(out, bool) else exp == (out is not None)
    if out == exp:
        return True
    if atol == 0 and _is_floats(exp):
        atol = 1e-6
    return atol != 0 and _allclose(out, exp, atol)


def canonical(x, depth=0):
    """A repr that is equal for equal values: sets sorted, dict items sorted, floats to 9 digits."""
    if depth > 50:
        return "..."
    if isinstance(x, float):
        return format(x, ".9g")
    if isinstance(x, (set, frozenset)):
        return "{" + ", ".join(sorted(canonical(i, depth + 1) for i in x)) + "}"
    if isinstance(x, dict):
        items = sorted((canonical(k, depth + 1), canonical(v, depth + 1)) for k, v in x.items())
        return "{" + ", ".join(f"{k}: {v}" for k, v in items) + "}"
    if isinstance(x, (list, tuple)):
        inner = ", ".join(canonical(i, depth + 1) for i in x)
        return ("[%s]" if isinstance(x, list) else "(%s)") % inner
    return repr(x)


def _short(e):
    return f"{type(e).__name__}: {e}"[:300].replace("\t", " ").replace("\n", " ")


def main():
    job = json.loads(sys.stdin.read())
    if hasattr(sys, "set_int_max_str_digits"):  # as EvalPlus: some MBPP+ outputs are huge ints
        sys.set_int_max_str_digits(50000)
    nonce, seconds = job["nonce"], float(job["per_test_seconds"])
    out = os.fdopen(os.dup(1), "w", buffering=1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    sys.stdout = sys.stderr = open(os.devnull, "w")
    signal.signal(signal.SIGALRM, _alarm)

    def emit(i, status, msg=""):
        out.write(f"{nonce}\t{i}\t{status}\t{msg}\n")

    g = {"__name__": "solution", "__builtins__": __builtins__}
    n_tests = len(job["tests"]) + len((job.get("diff") or {}).get("inputs", []))
    try:
        with open("solution.py") as f:
            src = f.read()
        _timed(seconds, exec, compile(src, "solution.py", "exec"), g)
        candidate = g.get(job["entry_point"])
        if not callable(candidate):
            raise NameError(f"the solution defines no function {job['entry_point']!r}")
        g["candidate"] = candidate
        _timed(seconds, exec, job["setup"], g)
    except BaseException as e:
        emit("load", "error", _short(e))
        for i in range(n_tests):
            emit(i, "error", "the solution did not load")
        out.write(f"{nonce}\tdone\n")
        return
    for i, test in enumerate(job["tests"]):
        try:
            _timed(seconds, exec, test, g)
            emit(i, "pass")
        except AssertionError as e:
            emit(i, "fail", _short(e))
        except _TestTimeout:
            emit(i, "timeout", f"over {seconds} s")
        except BaseException as e:
            emit(i, "error", _short(e))
    diff = job.get("diff")
    if diff:
        ref = {"__name__": "reference"}
        exec(compile(diff["reference"], "reference.py", "exec"), ref)
        ref_fn, base = ref[job["entry_point"]], len(job["tests"])
        for k, inp in enumerate(diff["inputs"]):
            i = base + k
            try:
                exp = ref_fn(*copy.deepcopy(inp))
            except BaseException as e:
                emit(i, "error", "the reference failed on this input: " + _short(e))
                continue
            try:
                got = _timed(seconds, candidate, *copy.deepcopy(inp))
                ok = _matches(got, exp, inp, float(diff["atol"]), diff.get("oracle") or "")
                emit(i, "pass" if ok else "fail", "" if ok else f"input {k}: got {canonical(got)[:100]}")
            except _TestTimeout:
                emit(i, "timeout", f"over {seconds} s")
            except BaseException as e:
                emit(i, "error", _short(e))
    for i, text in enumerate(job.get("probe_inputs") or []):
        try:
            args = ast.literal_eval("(" + text + ",)")
        except (ValueError, SyntaxError) as e:
            emit(i, "bad_input", _short(e))
            continue
        try:
            got = _timed(seconds, candidate, *args)
            emit(i, "out", canonical(got)[:2000].replace("\t", " ").replace("\n", "\\n"))
        except _TestTimeout:
            emit(i, "timeout", f"over {seconds} s")
        except BaseException as e:
            emit(i, "error", _short(e))
    out.write(f"{nonce}\tdone\n")


if __name__ == "__main__":
    main()

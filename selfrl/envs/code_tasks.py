"""The easy tier of the code environment: short generated functions with hidden tests.

HumanEval is too hard for a small model (the embedded 135M model solves about 3 %), so its
groups are all failures and RL has no signal. This family is a graded easy tier: one-line
functions on ints, lists and strings (add n, keep the numbers over t, count a letter,
replace a letter, ...), each kind over a grid of parameters, so that there are hundreds of
distinct tasks. Each is shown as HumanEval shows a problem (signature, a one-sentence
docstring, two examples with different results) and has ``N_TESTS`` hidden tests, ``assert candidate(...) == ...``
with the expected values of the reference solution on inputs drawn from a seed of the
task's own (the first two are the docstring's examples).

``easy_tasks()`` is the whole family, the same list on every machine and run: the kinds in
``KINDS`` order, each over its parameter grid; inputs from ``random.Random`` seeded with
the task id. The environment (``selfrl.envs.code``, ``tier = "easy"``) orders it by content
hash, as it orders HumanEval.

The reference solutions are this module's own source text, run here (trusted) to compute
the expected values; model-written code only ever runs in the sandbox.
"""

from __future__ import annotations

import functools
import random
import re
from collections.abc import Callable
from dataclasses import dataclass

from selfrl.envs.codeexec import CodeTask

__all__ = ["KINDS", "N_TESTS", "Kind", "easy_tasks"]

_PARAM = re.compile(r"\{\w+(?:![rs])?\}")  # a parameter in a kind's name
N_TESTS = 6  # hidden tests per task; the first 2 are the docstring's examples
_WORDS = ("apple", "banana", "cherry", "kiwi", "lemon", "mango", "melon", "peach", "plum", "grape", "sky", "tree",
          "river", "stone", "cloud", "data", "code", "python", "hello", "world", "the", "red", "this", "rest", "moon",
          "sun", "bread", "carrot")
_LETTERS = "aeiou" + "nrst"
_TAGS = ("pre", "un", "re", "x", "ab", "tag")
_NUMBER = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight", 9: "nine", 10: "ten"}


def _ints(rng: random.Random, params: dict) -> tuple:
    return (rng.randint(-20, 50),)


def _pos_ints(rng: random.Random, params: dict) -> tuple:
    return (rng.randint(0, 60),)


def _lists(rng: random.Random, params: dict) -> tuple:
    return ([rng.randint(0, 20) for _ in range(rng.randint(0, 6))],)


def _words(rng: random.Random, params: dict) -> tuple:
    return (rng.choice(_WORDS),)


def _lists_with_v(rng: random.Random, params: dict) -> tuple:
    """Lists that often hold ``params["v"]`` (else a count of it would nearly always be 0)."""
    (xs,) = _lists(rng, params)
    return (xs + [params["v"]] * rng.randint(0, 2) if xs else xs,)


def _texts(rng: random.Random, params: dict) -> tuple:
    return (" ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 3))),)


@dataclass(frozen=True)
class Kind:
    """One kind of task: a function template over a parameter grid.

    Attributes:
        name: the function's name, formatted with the parameters (e.g. ``"add_{n}"``).
        signature: the argument list with type hints and the return type, e.g. ``"x: int) -> int"``.
        doc: the docstring's sentence, formatted with the parameters.
        body: the reference body (one or more lines, indented 4), formatted with the parameters.
        params: the parameter grid, one dict per task.
        inputs: ``(rng, params) -> args``, one argument tuple.
    """

    name: str
    signature: str
    doc: str
    body: str
    params: tuple[dict, ...]
    inputs: Callable[[random.Random, dict], tuple]


def _grid(**axes) -> tuple[dict, ...]:
    out: list[dict] = [{}]
    for key, values in axes.items():
        out = [{**d, key: v} for d in out for v in values]
    return tuple(out)


KINDS: tuple[Kind, ...] = (
    Kind("add_{n}", "x: int) -> int", "Return x plus {n}.", "    return x + {n}\n",
         _grid(n=range(2, 31)), _ints),
    Kind("times_{n}", "x: int) -> int", "Return x multiplied by {n}.", "    return x * {n}\n",
         _grid(n=range(2, 21)), _ints),
    Kind("scale_{a}_shift_{b}", "x: int) -> int", "Return {a} times x plus {b}.", "    return {a} * x + {b}\n",
         _grid(a=range(2, 8), b=range(1, 8)), _ints),
    Kind("is_multiple_of_{k}", "x: int) -> bool", "Return True if x is divisible by {k}, else False.",
         "    return x % {k} == 0\n", _grid(k=range(2, 13)), _pos_ints),
    Kind("add_{n}_to_each", "xs: list) -> list", "Return a new list with {n} added to every number of xs.",
         "    return [x + {n} for x in xs]\n", _grid(n=range(1, 21)), _lists),
    Kind("times_{n}_each", "xs: list) -> list", "Return a new list with every number of xs multiplied by {n}.",
         "    return [x * {n} for x in xs]\n", _grid(n=range(2, 11)), _lists),
    Kind("keep_above_{t}", "xs: list) -> list", "Return the numbers of xs that are greater than {t}, in order.",
         "    return [x for x in xs if x > {t}]\n", _grid(t=range(1, 20)), _lists),
    Kind("count_above_{t}", "xs: list) -> int", "Return how many numbers of xs are greater than {t}.",
         "    return sum(1 for x in xs if x > {t})\n", _grid(t=range(1, 20)), _lists),
    Kind("sum_multiples_of_{k}", "xs: list) -> int", "Return the sum of the numbers of xs that are divisible by {k}.",
         "    return sum(x for x in xs if x % {k} == 0)\n", _grid(k=range(2, 8)), _lists),
    Kind("first_{n}", "xs: list) -> list", "Return the first {n} items of xs (all of them if it has fewer).",
         "    return xs[:{n}]\n", _grid(n=range(1, 6)), _lists),
    Kind("count_{v}s", "xs: list) -> int", "Return how many times the number {v} occurs in xs.",
         "    return xs.count({v})\n", _grid(v=range(0, 21)), _lists_with_v),
    Kind("repeat_{n}_times", "s: str) -> str", "Return the string s repeated {n} times.", "    return s * {n}\n",
         _grid(n=range(2, 6)), _words),
    Kind("prefix_{p}", "s: str) -> str", "Return s with {p!r} added at the start.", "    return {p!r} + s\n",
         _grid(p=_TAGS), _words),
    Kind("suffix_{p}", "s: str) -> str", "Return s with {p!r} added at the end.", "    return s + {p!r}\n",
         _grid(p=_TAGS), _words),
    Kind("count_{c}", "s: str) -> int", "Return how many times the letter {c!r} occurs in s.",
         "    return s.count({c!r})\n", _grid(c=_LETTERS), _texts),
    Kind("replace_{a}_with_{b}", "s: str) -> str", "Return s with every {a!r} replaced by {b!r}.",
         "    return s.replace({a!r}, {b!r})\n", _grid(a="aeiou", b="xyzkw"), _texts),
    Kind("remove_{c}", "s: str) -> str", "Return s with every letter {c!r} removed.",
         "    return s.replace({c!r}, '')\n", _grid(c=_LETTERS), _texts),
    Kind("starts_with_{p}", "s: str) -> bool", "Return True if s starts with {p!r}, else False.",
         "    return s.startswith({p!r})\n", _grid(p=("a", "b", "c", "m", "p", "s", "th", "re")), _words),
    Kind("longer_than_{n}", "s: str) -> bool", "Return True if s has more than {n} characters, else False.",
         "    return len(s) > {n}\n", _grid(n=range(3, 10)), _texts),
)


def _task(kind: Kind, params: dict) -> CodeTask:
    name = kind.name.format(**params)
    head = f"def {name}({kind.signature}:\n"
    ref_src = head + kind.body.format(**params)
    scope: dict = {}
    exec(compile(ref_src, f"<reference {name}>", "exec"), scope)  # our own template, never model code
    ref = scope[name]
    task_id = f"CodeEasy/{_PARAM.sub('N', kind.name)}/{name}"  # e.g. CodeEasy/add_N/add_2
    rng = random.Random(task_id)
    inputs: list[tuple] = []
    for _ in range(1000):  # distinct inputs; the two examples' expected values differ
        args = kind.inputs(rng, params)
        if args not in inputs and not (len(inputs) == 1 and repr(ref(*args)) == repr(ref(*inputs[0]))):
            inputs.append(args)
        if len(inputs) == N_TESTS:
            break
    if len(inputs) < N_TESTS:
        raise AssertionError(f"{name}: fewer than {N_TESTS} distinct telling inputs (a bug in KINDS)")

    def call(args: tuple) -> str:
        return f"{name}({', '.join(map(repr, args))})"

    examples = "".join(f"    >>> {call(a)}\n    {ref(*a)!r}\n" for a in inputs[:2])
    prompt = head + f'    """{kind.doc.format(**params)}\n{examples}    """\n'
    tests = tuple(f"assert candidate({', '.join(map(repr, a))}) == {ref(*a)!r}" for a in inputs)
    return CodeTask(task_id, prompt, name, tests, reference=prompt + kind.body.format(**params), source="code-easy")


@functools.cache
def easy_tasks() -> tuple[CodeTask, ...]:
    """The whole easy family, in ``KINDS`` order (deterministic; see the module docstring).

    Raises:
        AssertionError: two tasks share a name (a bug in ``KINDS``).
    """
    tasks = tuple(_task(kind, p) for kind in KINDS for p in kind.params)
    assert len({t.task_id for t in tasks}) == len(tasks), "two easy code tasks share a name"
    return tasks

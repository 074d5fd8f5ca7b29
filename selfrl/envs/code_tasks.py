"""The easy tier of the code environment: short generated functions with hidden tests.

HumanEval is too hard for a small model (the embedded 135M model solves about 3 %), so its
groups are all failures and RL has no signal. This family is an easier tier: one-line
functions that chain two or three simple steps on a list of ints or on a string, e.g.
``sum_times_3_over_5(xs: list) -> int``, "Take the numbers of xs that are greater than 5,
multiply each by 3, and return their sum."

Lists: an optional filter (greater / less than t, even, odd, divisible by k), an optional
map (add n, subtract n, multiply by n, square), then a result (the list, the sum, the
count, the largest). Strings: one or two edits (replace a letter, remove a letter, reverse,
upper case), then a result (the string, the count of a letter, the length). One step alone
is too easy for the 135M model (about 3 in 4 solved); two and three steps are where it
has signal (docs/reference/environments/code-and-function-calling.md has the numbers).

Each task is shown as HumanEval shows a problem (signature, the sentence, two examples with
different results) and has ``N_TESTS`` hidden tests, ``assert candidate(...) == ...``, the
expected values of the reference solution on inputs drawn from a seed of the task's own;
the first two are the docstring's examples. ``easy_tasks()`` is the whole family:
``N_TASKS`` distinct tasks drawn from the fixed seed ``FAMILY_SEED``, the same on every
machine and run. The environment (``selfrl.envs.code``, ``tier = "easy"``) orders it by
content hash, as it orders HumanEval.

The reference solutions are this module's own text, run here (trusted) to compute the
expected values; model-written code only ever runs in the sandbox.
"""

from __future__ import annotations

import functools
import random

from selfrl.envs.codeexec import CodeTask

__all__ = ["FAMILY_SEED", "N_TASKS", "N_TESTS", "easy_tasks"]

FAMILY_SEED = "selfrl-code-easy-v1"
N_TASKS = 600  # distinct tasks in the family
N_TESTS = 6  # hidden tests per task; the first 2 are the docstring's examples
_WORDS = ("apple", "banana", "cherry", "kiwi", "lemon", "mango", "melon", "peach", "plum", "grape", "sky", "tree",
          "river", "stone", "cloud", "data", "code", "python", "hello", "world", "the", "red", "this", "rest", "moon",
          "sun", "bread", "carrot")

# list steps: (name part, words, Python); {v} is the step's parameter
_FILTERS = (("over_{v}", "that are greater than {v}", "x > {v}", range(2, 15)),
            ("under_{v}", "that are less than {v}", "x < {v}", range(5, 18)),
            ("evens", "that are even", "x % 2 == 0", (0,)),
            ("odds", "that are odd", "x % 2 == 1", (0,)),
            ("div_by_{v}", "that are divisible by {v}", "x % {v} == 0", range(3, 6)))
_MAPS = (("plus_{v}", "add {v} to each", "x + {v}", range(1, 10)),
         ("minus_{v}", "subtract {v} from each", "x - {v}", range(1, 10)),
         ("times_{v}", "multiply each by {v}", "x * {v}", range(2, 6)),
         ("squared", "square each", "x * x", (0,)))
_RESULTS = (("list", "return them as a list, in order", "[{e} for x in xs{f}]", "list"),
            ("sum", "return their sum", "sum({e} for x in xs{f})", "int"),
            ("count", "return how many there are", "sum(1 for x in xs{f})", "int"),
            ("max", "return the largest of them (0 if there is none)", "max(({e} for x in xs{f}), default=0)", "int"))
# string steps
_EDITS = (("swap_{a}_{b}", "replace every {a!r} with {b!r}", "{s}.replace({a!r}, {b!r})"),
          ("drop_{a}", "remove every {a!r}", "{s}.replace({a!r}, '')"),
          ("reversed", "reverse it", "{s}[::-1]"),
          ("upper", "make it upper case", "{s}.upper()"))
_ENDS = (("text", "return the result", "{s}", "str"),
         ("count_{c}", "return how many times {c!r} occurs in it", "{s}.count({c!r})", "int"),
         ("length", "return its length", "len({s})", "int"))


def _list_spec(rng: random.Random) -> tuple[str, str, str, str, str]:
    """(shape, name, sentence, body, return type) of a list task with 2-3 steps."""
    while True:
        flt = rng.choice(_FILTERS) if rng.random() < 0.8 else None
        mp = rng.choice(_MAPS) if rng.random() < 0.7 else None
        res = rng.choice(_RESULTS)
        if res[0] == "count":
            mp = None  # counting ignores a map
        steps = (flt is not None) + (mp is not None) + (res[0] != "list")
        if steps >= 2:
            break
    fv = rng.choice(flt[3]) if flt else 0
    mv = rng.choice(mp[3]) if mp else 0
    parts, words = [res[0]], "Take the numbers of xs"
    if flt:
        words += " " + flt[1].format(v=fv)
    if mp:
        parts.append(mp[0].format(v=mv))
        words += ", " + mp[1].format(v=mv) + ","
    else:
        words += ","
    if flt:
        parts.append(flt[0].format(v=fv))
    words += " and " + res[1] + "."
    expr = res[2].format(e=mp[2].format(v=mv) if mp else "x", f=f" if {flt[2].format(v=fv)}" if flt else "")
    shape = "-".join(p for p in ("filter" if flt else "", "map" if mp else "", res[0]) if p)
    return shape, "_".join(parts), words, f"    return {expr}\n", f"xs: list) -> {res[3]}"


def _str_spec(rng: random.Random) -> tuple[str, str, str, str, str]:
    """(shape, name, sentence, body, return type) of a string task with 2-3 steps."""
    end = rng.choice(_ENDS)
    edits = [rng.choice(_EDITS) for _ in range(1 if end[0] != "text" else 2)]
    if end[0] != "text" and rng.random() < 0.4:
        edits.append(rng.choice(_EDITS))
    letters = "aeiou"
    s, names, words = "s", [], []
    for e in edits:
        a, b = rng.choice(letters), rng.choice("xyzkw")
        s = e[2].format(s=s, a=a, b=b)
        names.append(e[0].format(a=a, b=b))
        words.append(e[1].format(a=a, b=b))
    c = rng.choice(letters + "nrst")
    if any(e[0] == "upper" for e in edits):
        c = c.upper()
    names.append(end[0].format(c=c))
    sentence = "Take s, " + ", ".join(words) + ", and " + end[1].format(c=c) + "."
    shape = f"edit{len(edits)}-{end[0].split('_')[0]}"
    return shape, "_".join(names), sentence, f"    return {end[2].format(s=s, c=c)}\n", f"s: str) -> {end[3]}"


def _draw_list(rng: random.Random) -> tuple:
    return ([rng.randint(0, 20) for _ in range(rng.randint(0, 6))],)


def _draw_text(rng: random.Random) -> tuple:
    return (" ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 3))),)


def _task(shape: str, name: str, sentence: str, body: str, signature: str) -> CodeTask | None:
    """The task, or None when no two inputs give different results (a step undoes another)."""
    head = f"def {name}({signature}:\n"
    scope: dict = {}
    exec(compile(head + body, f"<reference {name}>", "exec"), scope)  # our own template, never model code
    ref = scope[name]
    task_id = f"CodeEasy/{shape}/{name}"
    rng = random.Random(task_id)
    draw = _draw_list if signature.startswith("xs") else _draw_text
    inputs: list[tuple] = []
    for _ in range(1000):  # distinct inputs; the two examples' expected values differ
        args = draw(rng)
        if args not in inputs and not (len(inputs) == 1 and repr(ref(*args)) == repr(ref(*inputs[0]))):
            inputs.append(args)
        if len(inputs) == N_TESTS:
            break
    if len(inputs) < N_TESTS:
        return None

    def call(args: tuple) -> str:
        return f"{name}({', '.join(map(repr, args))})"

    examples = "".join(f"    >>> {call(a)}\n    {ref(*a)!r}\n" for a in inputs[:2])
    prompt = head + f'    """{sentence}\n{examples}    """\n'
    tests = tuple(f"assert candidate({', '.join(map(repr, a))}) == {ref(*a)!r}" for a in inputs)
    return CodeTask(task_id, prompt, name, tests, reference=prompt + body, source="code-easy")


@functools.cache
def easy_tasks() -> tuple[CodeTask, ...]:
    """The whole family: ``N_TASKS`` distinct tasks, in draw order from ``FAMILY_SEED``, about 2 in 3
    on lists (deterministic; see the module docstring).

    >>> task = next(t for t in easy_tasks() if t.entry_point == "sum_times_3_over_5")
    >>> task.task_id, task.tests[2]
    ('CodeEasy/filter-map-sum/sum_times_3_over_5', 'assert candidate([17]) == 51')
    """
    rng = random.Random(FAMILY_SEED)
    tasks: dict[str, CodeTask] = {}
    while len(tasks) < N_TASKS:
        spec = _list_spec(rng) if rng.random() < 2 / 3 else _str_spec(rng)
        if spec[1] not in tasks and (task := _task(*spec)) is not None:
            tasks[spec[1]] = task
    return tuple(tasks.values())

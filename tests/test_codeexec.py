"""selfrl.envs.codeexec: hidden tests in the sandbox (per-test verdicts), task loaders, label-free agreement."""

from pathlib import Path

import pytest

from selfrl.envs.codeexec import (
    CodeTask,
    codet_scores,
    execution_agreement,
    load_evalplus,
    load_humaneval,
    load_mbpp_jsonl,
    run_on_inputs,
    run_tests,
)
from selfrl.envs.sandbox import Limits, Sandbox

FIX = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def box():
    return Sandbox(Limits(wall_seconds=20))


@pytest.fixture(scope="module")
def humaneval():
    return {t.task_id: t for t in load_humaneval()}


def test_humaneval_has_164_problems_split_into_1181_tests(humaneval):
    assert len(humaneval) == 164
    assert sum(len(t.tests) for t in humaneval.values()) == 1181
    he0 = humaneval["HumanEval/0"]
    assert he0.entry_point == "has_close_elements" and len(he0.tests) == 7
    assert he0.setup.startswith("METADATA") and he0.source == "humaneval"
    # HumanEval/32's seeded loop stays one test, with its imports and RNG in front of it
    assert len(humaneval["HumanEval/32"].tests) == 1


def test_reference_passes_and_a_wrong_solution_fails_exactly_where_expected(humaneval, box):
    he0 = humaneval["HumanEval/0"]
    ok = run_tests(he0, he0.reference, box)
    assert ok.all_passed and ok.pass_rate == 1.0 and ok.load_error is None
    # Always True: the 7 asserts expect True, False, True, False, True, True, False.
    bad = run_tests(he0, he0.prompt + "    return True\n", box)
    assert bad.statuses == ("pass", "fail", "pass", "fail", "pass", "pass", "fail")
    assert bad.passed == (True, False, True, False, True, True, False)
    assert not bad.all_passed and bad.pass_rate == pytest.approx(4 / 7)


def test_a_hanging_test_times_out_alone_and_broken_programs_never_pass(humaneval, box):
    he0 = humaneval["HumanEval/0"]
    hang = he0.reference.replace('    """\n', '    """\n    while threshold == 0.05:\n        pass\n', 1)
    rep = run_tests(he0, hang, box, per_test_seconds=0.5)
    assert rep.statuses == ("pass", "timeout", "pass", "pass", "pass", "pass", "pass")
    syntax = run_tests(he0, "def has_close_elements(:\n", box)
    assert syntax.load_error.startswith("SyntaxError") and set(syntax.statuses) == {"error"}
    missing = run_tests(he0, "def other(): pass\n", box)
    assert "defines no function 'has_close_elements'" in missing.load_error
    exits = run_tests(he0, "import os\nos._exit(0)\n", box)
    assert set(exits.statuses) == {"not_run"} and not exits.all_passed
    forged = "print('pass\\n' * 10)\nimport sys\nsys.exit(0)\n"
    assert not run_tests(he0, forged, box).all_passed


def test_mbpp_format(box):
    tasks = load_mbpp_jsonl(FIX / "mbpp_sample.jsonl")
    assert [(t.task_id, t.entry_point, len(t.tests)) for t in tasks] == [
        ("901", "max_of_three", 3), ("902", "count_vowels", 2)]
    assert tasks[1].setup == "WORD = 'education'"
    assert all(run_tests(t, t.reference, box).all_passed for t in tasks)
    off_by_one = "def count_vowels(s):\n    return sum(ch in 'aeiou' for ch in s) + (s == 'hello')"
    assert run_tests(tasks[1], off_by_one, box).statuses == ("fail", "pass")


def test_evalplus_humaneval_plus_differential_tests(box):
    tasks = {t.task_id: t for t in load_evalplus(FIX / "evalplus_humaneval_sample.jsonl")}
    mean = tasks["HumanEval/900"]
    assert mean.source == "humaneval+" and mean.n_tests == 3 and mean.diff.atol == 0.0
    assert len(load_evalplus(FIX / "evalplus_humaneval_sample.jsonl", plus=False)[0].diff.inputs) == 2
    assert run_tests(mean, mean.reference, box).all_passed
    # float outputs get atol 1e-6 (EvalPlus): 1e-9 off passes, 1e-3 off fails
    near = mean.prompt + "    return sum(xs) / len(xs) + 1e-9\n"
    far = mean.prompt + "    return sum(xs) / len(xs) + 1e-3\n"
    assert run_tests(mean, near, box).all_passed
    assert run_tests(mean, far, box).statuses == ("fail", "fail", "fail")
    # find_zero: any root within atol passes (the reference finds 1.0, this one 3.0)
    fz = tasks["HumanEval/32"]
    assert fz.diff.oracle == "find_zero" and run_tests(fz, fz.reference, box).all_passed
    other_root = fz.prompt + "    return 3.0 if xs == [-6, 11, -6, 1] else -0.5\n"
    assert run_tests(fz, other_root, box).all_passed


def test_evalplus_mbpp_plus_set_oracle(box):
    (task,) = load_evalplus(FIX / "mbppplus_sample.jsonl")
    assert task.source == "mbpp+" and task.diff.oracle == "set_eq" and task.n_tests == 3
    reordered = "def similar_elements(a, b):\n    return tuple(sorted(set(a) & set(b), reverse=True))"
    assert run_tests(task, reordered, box).all_passed
    assert run_tests(task, "def similar_elements(a, b):\n    return (4,)", box).statuses == ("fail", "fail", "fail")


def test_loaders_refuse_missing_files_and_fields(tmp_path):
    with pytest.raises(FileNotFoundError, match="downloads nothing"):
        load_evalplus(tmp_path / "HumanEvalPlus.jsonl")
    bad = tmp_path / "x.jsonl"
    bad.write_text('{"task_id": "HumanEval/1", "prompt": "p"}\n')
    with pytest.raises(ValueError, match="lacks"):
        load_evalplus(bad)
    bad.write_text("not json\n")
    with pytest.raises(ValueError, match="not JSON"):
        load_mbpp_jsonl(bad)


def test_run_on_inputs_and_execution_agreement(box):
    inputs = ["2", "3", "'x'"]
    samples = ["def f(n):\n    return n * 2",
               "def f(n):\n    return n + n",
               "def f(n):\n    return n ** 2",
               "def f(n):\n    raise ValueError"]
    outs = [run_on_inputs(s, "f", inputs, box) for s in samples]
    assert outs[0] == ["4", "6", "'xx'"] and outs[1] == outs[0]
    assert outs[2] == ["4", "9", None] and outs[3] == [None, None, None]
    # samples 0 and 1 agree with each other (1 of 3 others each); 2 fails on 'x'; 3 fails everywhere
    assert execution_agreement(outs) == [1 / 3, 1 / 3, 0.0, 0.0]
    with pytest.raises(ValueError, match="at least 2"):
        execution_agreement([["1"]])


def test_codet_scores_by_hand():
    # vectors: A=(1,1,0) x2 -> 2*2=4; B=(1,0,0) x1 -> 1; C=(0,0,0) x1 -> 0; divided by 4*3
    assert codet_scores([[1, 1, 0], [1, 1, 0], [1, 0, 0], [0, 0, 0]]) == [4 / 12, 4 / 12, 1 / 12, 0.0]
    assert codet_scores([[True], [True]]) == [1.0, 1.0]
    with pytest.raises(ValueError):
        codet_scores([])


def test_per_test_seconds_must_be_positive(box):
    with pytest.raises(ValueError, match="per_test_seconds"):
        run_tests(CodeTask("t", "", "f", ("assert f()",)), "def f(): return 1", box, per_test_seconds=0)

"""Tests for selfrl.core.tasks: real reasoning-gym tasks, no stand-ins."""

from __future__ import annotations

import json

import pytest

from selfrl.core.tasks import Task, TaskSource, assert_disjoint, extract_answer, split_tasks, task_id
from selfrl.envs.arithmetic import ReasoningGymEnv
from selfrl.envs.registry import available_envs, get_env, register_env


@pytest.fixture(scope="module")
def chain_sum() -> TaskSource:
    return get_env("chain_sum")


def test_sample_is_deterministic_by_seed(chain_sum):
    a = chain_sum.sample(20, seed=7)
    b = chain_sum.sample(20, seed=7)
    c = chain_sum.sample(20, seed=8000)
    assert a == b
    assert [t.question for t in a] != [t.question for t in c]
    assert all(t.source == "chain_sum" for t in a)


def test_id_is_content_hash_across_seeds(chain_sum):
    # reasoning-gym seeds item i of seed s with s + i: item 1 of seed 3 is item 0 of seed 4.
    a = chain_sum.sample(2, seed=3)[1]
    b = chain_sum.sample(1, seed=4)[0]
    assert a.question == b.question
    assert a.id == b.id == task_id("chain_sum", a.question)
    assert a.metadata["seed"] != b.metadata["seed"]


def test_small_chain_sum_config(chain_sum):
    for task in chain_sum.sample(50, seed=0):
        expression = task.metadata["entry"]["metadata"]["expression"]
        numbers = [int(tok) for tok in expression.split() if tok not in "+-"]
        assert 2 <= len(numbers) <= 3
        assert all(0 <= x <= 99 for x in numbers)
        assert task.question.endswith(f"{expression} =")


def test_metadata_is_json_serializable_and_scores_after_round_trip(chain_sum):
    task = chain_sum.sample(1, seed=5)[0]
    restored = Task(**json.loads(json.dumps(task.__dict__)))
    assert restored == task
    assert chain_sum.score(restored, task.answer) == 1.0


def test_score_right_and_wrong_answer_on_real_chain_sum_task(chain_sum):
    task = chain_sum.sample(1, seed=11)[0]
    right = task.answer
    wrong = str(int(task.answer) + 1)
    assert right not in wrong  # reasoning-gym gives partial credit when the answer is a substring
    assert chain_sum.score(task, right) == 1.0
    assert chain_sum.correct(task, right)
    assert chain_sum.score(task, f"{int(right):+d}.00") == 1.0  # decimal compare
    assert chain_sum.score(task, wrong) == 0.0
    assert not chain_sum.correct(task, wrong)
    assert chain_sum.score(task, None) == 0.0
    # reasoning-gym's partial credit: a wrong answer containing the right one scores len(right)/len(wrong).
    padded = right + "0"
    assert 0.0 < chain_sum.score(task, padded) < 1.0 and not chain_sum.correct(task, padded)
    assert chain_sum.correct(task, chain_sum.extract_answer(f"Adding up... <answer>{right}</answer>"))


def test_score_refuses_task_from_other_source(chain_sum):
    task = get_env("basic_arithmetic").sample(1, seed=0)[0]
    with pytest.raises(ValueError, match="basic_arithmetic"):
        chain_sum.score(task, task.answer)


def test_basic_arithmetic_scores_its_own_answers():
    source = get_env("basic_arithmetic")
    tasks = source.sample(20, seed=1)
    assert all(source.correct(t, t.answer) for t in tasks)
    assert all(t.question.startswith("Calculate ") for t in tasks)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<answer>42</answer>", "42"),
        ("so it is 1,234.", "1234"),
        ("-5", "-5"),
        ("no number", None),
        ("<answer>1</answer> wait, <answer> 2 </answer>", "2"),
        ("<answer>7</answer> but 9 is bigger", "7"),
        ("x = -3.25 or 4.5", "4.5"),
        ("10 - 3 = 7", "7"),
        ("5-3", "3"),
        ("the point (3,4)", "4"),
        ("thinking... <answer>17", "17"),
        ("<answer>  </answer> 5", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_split_is_disjoint_and_deterministic(chain_sum):
    train, val = split_tasks(chain_sum, n_train=200, n_val=50, train_seed=1, val_seed=2)
    assert len(train) == 200 and len(val) == 50
    assert not {t.id for t in train} & {t.id for t in val}
    assert (train, val) == split_tasks(chain_sum, n_train=200, n_val=50, train_seed=1, val_seed=2)


def test_split_removes_leaks_when_seeds_collide(chain_sum):
    # Same seed: the first 30 training tasks would be exactly the validation tasks.
    naive = chain_sum.sample(100, seed=9)
    val_ids = {t.id for t in chain_sum.sample(30, seed=9)}
    assert sum(t.id in val_ids for t in naive) >= 30
    with pytest.raises(ValueError, match="in both train and validation"):
        assert_disjoint(naive, chain_sum.sample(30, seed=9))

    train, val = split_tasks(chain_sum, n_train=100, n_val=30, train_seed=9, val_seed=9)
    assert len(train) == 100 and len(val) == 30
    assert not {t.id for t in train} & {t.id for t in val}
    assert_disjoint(train, val)
    # The leak-free items of the seed-9 sample are kept, in order; the rest is topped up.
    kept = [t for t in naive if t.id not in val_ids]
    assert train[: len(kept)] == kept


def test_assert_disjoint_names_overlapping_ids(chain_sum):
    tasks = chain_sum.sample(3, seed=0)
    with pytest.raises(ValueError) as err:
        assert_disjoint(tasks[:2], tasks[1:])
    assert tasks[1].id in str(err.value)


def test_split_raises_when_source_is_exhausted():
    # 1-term, 1-digit chain sums have only 10 distinct questions.
    source = get_env("chain_sum", min_terms=1, max_terms=1, max_digits=1)
    # Validation asks for more distinct questions than exist.
    with pytest.raises(ValueError, match="only 10 distinct tasks of the 200"):
        split_tasks(source, n_train=5, n_val=200, train_seed=0, val_seed=0, max_rounds=5)
    # Validation takes all 10, so none is left for training.
    with pytest.raises(ValueError, match="training tasks outside validation"):
        split_tasks(source, n_train=5, n_val=10, train_seed=0, val_seed=0, max_rounds=50)


def test_unknown_source_error_lists_valid_names():
    with pytest.raises(ValueError) as err:
        get_env("no_such_source")
    message = str(err.value)
    for name in available_envs():
        assert name in message
    assert {"chain_sum", "basic_arithmetic"} <= set(available_envs())


def test_rg_prefix_passes_dataset_through_and_lists_names_when_unknown():
    source = get_env("rg:leg_counting")
    assert isinstance(source, ReasoningGymEnv)
    task = source.sample(1, seed=0)[0]
    assert source.correct(task, task.answer)
    with pytest.raises(ValueError, match="chain_sum"):
        get_env("rg:no_such_dataset")


def test_overrides_and_unknown_config_fields():
    source = get_env("chain_sum", max_terms=2)
    assert source.config["max_terms"] == 2 and source.config["min_digits"] == 1
    with pytest.raises(ValueError, match="min_terms"):
        get_env("chain_sum", n_terms=2)
    with pytest.raises(ValueError, match="invalid config"):
        get_env("chain_sum", min_terms=3, max_terms=2)


def test_register_rejects_duplicates_and_reserved_prefix():
    with pytest.raises(ValueError, match="already registered"):
        register_env("chain_sum", lambda: get_env("rg:chain_sum"))
    with pytest.raises(ValueError, match="reserved"):
        register_env("rg:mine", lambda: get_env("rg:chain_sum"))


class _Counted(TaskSource):
    """``size`` distinct questions, whatever the seed; counts the tasks drawn."""

    name = "counted"

    def __init__(self, size: int, repeat: int = 1):
        self.size, self.repeat, self.drawn = size, repeat, 0

    def sample(self, n, seed):
        self.drawn += n
        return [Task.make(self.name, f"q{(seed + i // self.repeat) % self.size}", "a") for i in range(n)]

    def score(self, task, answer):
        return 0.0


def test_a_source_with_too_few_tasks_is_found_out_before_the_rounds_of_top_ups():
    from selfrl.core.tasks import count_distinct, distinct_sample

    source = _Counted(950)
    with pytest.raises(ValueError) as err:
        distinct_sample(source, 100_000, seed=3)
    assert str(err.value) == ("source 'counted' gave only 950 distinct tasks of the 100000 asked for "
                              "(sampled until no new one came)")
    assert source.drawn == 100_000 + 4 * 2048  # the first round, then one probe that found 950 and three that found none
    assert count_distinct(_Counted(950), 64, 3) == 64 and count_distinct(_Counted(40), 64, 3) == 40
    twice = _Counted(5000, repeat=2)  # each question twice in a draw: the first round gives half, top-ups the rest
    tasks = distinct_sample(twice, 3000, seed=1)
    assert len({t.id for t in tasks}) == 3000 and tasks[:1500] == twice.sample(3000, 1)[::2]

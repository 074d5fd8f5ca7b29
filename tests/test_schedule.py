"""``selfrl.rl.schedule``: the learning rate of each update of a run (warmup, then constant,
linear or cosine), the config that chooses it, and the learner and loop that apply it."""

import json
import math

import pytest
import torch

from selfrl.config import ConfigError, load_config
from selfrl.rl.schedule import SCHEDULES, lr_factor, warmup_updates


@pytest.mark.parametrize("kind, warmup, expected", [
    ("constant", 0.0, [1, 1, 1, 1, 1, 1, 1, 1]),
    ("linear", 0.0, [1, 7 / 8, 6 / 8, 5 / 8, 4 / 8, 3 / 8, 2 / 8, 1 / 8]),
    # cos(pi k / 8) for k = 0..7, halved and lifted
    ("cosine", 0.0, [(1 + math.cos(math.pi * k / 8)) / 2 for k in range(8)]),
    # ceil(0.25 x 8) = 2 warmup updates at 1/3, 2/3; then 6 updates of decay
    ("linear", 0.25, [1 / 3, 2 / 3, 1, 5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6]),
    ("constant", 0.25, [1 / 3, 2 / 3, 1, 1, 1, 1, 1, 1]),
])
def test_the_factor_of_each_of_eight_updates(kind, warmup, expected):
    assert [lr_factor(kind, i, 8, warmup) for i in range(8)] == pytest.approx(expected, abs=1e-12)


def test_no_update_has_rate_zero_and_past_the_end_keeps_the_last_factor():
    for kind in SCHEDULES:
        for total in (1, 2, 3, 16):
            for ratio in (0.0, 0.1, 0.5, 0.99):
                factors = [lr_factor(kind, i, total, ratio) for i in range(total)]
                assert all(0 < f <= 1 for f in factors), (kind, total, ratio, factors)
        assert lr_factor(kind, 20, 16) == lr_factor(kind, 15, 16)  # resumed to fewer iterations
    assert lr_factor("linear", 0, 1) == 1.0 and lr_factor("linear", 0, 1, 0.99) == 1.0  # one update: full rate
    assert warmup_updates(16, 0.1) == 2 and warmup_updates(10, 0.5) == 5


@pytest.mark.parametrize("args, message", [
    (("step", 0, 4), "unknown learning-rate schedule 'step'; valid: constant, linear, cosine"),
    (("linear", 0, 0), "total >= 1"), (("linear", -1, 4), "update >= 0"), (("linear", 0, 4, 1.0), "warmup_ratio < 1")])
def test_bad_arguments_are_refused(args, message):
    with pytest.raises(ValueError, match=message):
        lr_factor(*args)


def test_the_config_takes_the_schedules_and_refuses_the_rest():
    from typing import get_args

    from selfrl.config.sections import LrSchedule

    assert get_args(LrSchedule) == SCHEDULES
    cfg = load_config(None, {"train.lr_scheduler_type": "cosine", "train.warmup_ratio": 0.1})
    assert (cfg.train.lr_scheduler_type, cfg.train.warmup_ratio) == ("cosine", 0.1)
    with pytest.raises(ConfigError, match="lr_scheduler_type must be one of 'constant', 'linear', 'cosine', got 'step'"):
        load_config(None, {"train.lr_scheduler_type": "step"})
    for bad in (1.0, -0.1):
        with pytest.raises(ConfigError, match="warmup_ratio"):
            load_config(None, {"train.warmup_ratio": bad})


@pytest.mark.parametrize("override", [{"train.lr_scheduler_type": "linear"}, {"train.warmup_ratio": 0.1}])
def test_serve_refuses_a_schedule_it_could_not_follow(override):
    from selfrl.serve.main import load_serve_config

    with pytest.raises(ConfigError, match="selfrl serve learns with no last update to decay toward: drop both"):
        load_serve_config(None, override)
    assert load_serve_config(None, {"train.lr_scheduler_type": "constant"}).train.warmup_ratio == 0


def test_a_warmup_that_leaves_no_update_after_it_is_refused():
    with pytest.raises(ConfigError, match="train.warmup_ratio = 0.6 of 2 iterations is 2 warmup updates, so none would "
                                          "run after the warmup: lower warmup_ratio, or raise iterations"):
        load_config(None, {"iterations": 2, "train.warmup_ratio": 0.6})
    with pytest.raises(ConfigError, match="0.76 of 4 iterations is 4 warmup updates"):
        load_config(None, {"iterations": 4, "train.warmup_ratio": 0.76})
    assert load_config(None, {"iterations": 4, "train.warmup_ratio": 0.75}).train.warmup_ratio == 0.75
    assert load_config(None, {"iterations": 1, "train.warmup_ratio": 0.5}).iterations == 1  # one update: full rate
    with pytest.raises(ConfigError, match="iterations must be"):  # out of range: the range's message, no traceback
        load_config(None, {"iterations": 10 ** 400, "train.warmup_ratio": 0.5})


def test_a_scheduled_run_resumes_only_with_its_schedule_over_its_iterations():
    from selfrl.config import check_resumable

    constant = load_config(None, {"iterations": 16}).to_dict()
    assert check_resumable(constant, load_config(None, {"iterations": 32}).to_dict()) is None
    linear16 = load_config(None, {"iterations": 16, "train.lr_scheduler_type": "linear"}).to_dict()
    assert check_resumable(linear16, linear16) is None
    for new in ({"iterations": 32, "train.lr_scheduler_type": "linear"},  # the rate would jump 0.0625 -> 0.5
                {"iterations": 16, "train.lr_scheduler_type": "cosine"},
                {"iterations": 16, "train.lr_scheduler_type": "linear", "train.warmup_ratio": 0.1}):
        with pytest.raises(ConfigError, match="--resume cannot change the learning-rate schedule of the stored run: it "
                                              "was train.lr_scheduler_type = 'linear', warmup_ratio = 0 over 16 "
                                              "iterations, and this would be .*resume with --iterations 16"):
            check_resumable(linear16, load_config(None, new).to_dict())
    with pytest.raises(ConfigError, match="learning-rate schedule"):  # adding one to a constant run moves its rate too
        check_resumable(constant, load_config(None, {"iterations": 16, "train.lr_scheduler_type": "cosine"}).to_dict())
    stored_before = {**constant, "train": {k: v for k, v in constant["train"].items()
                                           if k not in ("lr_scheduler_type", "warmup_ratio")}}
    assert check_resumable(stored_before, load_config(None, {"iterations": 40}).to_dict()) is None


def test_the_trl_arm_refuses_a_schedule_it_would_not_follow():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from trl_setup import grpo_args  # refuses before it imports TRL: no bench extra needed

    cfg = load_config(None, {"train.lr_scheduler_type": "cosine"})
    with pytest.raises(ValueError, match="compare the two at a constant rate"):
        grpo_args(cfg, False, 10)


def test_the_learner_steps_at_the_rate_times_the_factor(tiny_model_factory, tiny_tokenizer):
    from test_trainer import learner, params, sample

    full, quarter = (tiny_model_factory(seed=3, eos_bias=2.5, lora=True, default_init=True) for _ in range(2))
    trajs = sample(full, tiny_tokenizer)
    b0 = params(full, "lora_B")
    assert all(torch.equal(b0[k], v) for k, v in params(quarter, "lora_B").items())  # the same start
    m_full = learner(full, tiny_tokenizer).step(trajs)
    m_quarter = learner(quarter, tiny_tokenizer).step(trajs, lr_factor=0.25)
    assert (m_full.stats["learning_rate"], m_quarter.stats["learning_rate"]) == (1e-2, 2.5e-3)
    # AdamW's first step moves each weight by lr x g / (|g| + eps): the same g, a quarter of the rate
    d_full = torch.cat([(v - b0[k]).flatten() for k, v in params(full, "lora_B").items()])
    d_quarter = torch.cat([(v - b0[k]).flatten() for k, v in params(quarter, "lora_B").items()])
    assert d_full.abs().max() > 1e-3
    torch.testing.assert_close(d_quarter, 0.25 * d_full, rtol=1e-3, atol=1e-7)


def test_a_run_logs_the_rate_of_each_update(tmp_path, model_dir, short_reward):
    from test_loop import make_cfg

    from selfrl.run.main import run

    cfg = make_cfg(model_dir, tmp_path / "r", iterations=4, lr_scheduler_type="linear", learning_rate=1e-3)
    cfg.gate.eval_every = 4
    cfg.collapse.enabled = False  # a backoff would lower the rate too (the two multiply)
    run(cfg)
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    rates = [r["learning_rate"] for r in rows if "learning_rate" in r]
    assert rates == pytest.approx([1e-3, 7.5e-4, 5e-4, 2.5e-4])

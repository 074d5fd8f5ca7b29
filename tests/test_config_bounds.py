"""Every numeric setting has a bound, checked before anything loads, refused in one line that
names the field, the value and the allowed range; the bounds a model sets (LoRA rank, token
limits) are checked from its config before its weights load (selfrl.model.fit)."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from selfrl.model import load as model_module
from selfrl.cli import main
from selfrl.config import ConfigError, RunConfig, load_config
from selfrl.model.load import build_policy
from selfrl.config.serve import ServeConfig
from selfrl.serve.main import load_serve_config

# Fields whose huge values mean "never" (a threshold that never fires) or that are in reward
# units, which have no scale of their own: any finite value is accepted.
THRESHOLDS = {
    "train.max_grad_norm", "train.skip_max_reward_spread", "train.skip_max_kl", "train.skip_max_grad_norm",
    "train.tis_cap", "collapse.max_kl", "collapse.entropy_reward_gain", "collapse.reward_rise",
    "detectors.paid_reward", "detectors.dominance_min_fall", "warm_start.min_reward", "swap_check.tolerance",
}


def numeric_fields(cls, prefix=""):
    """``(dotted name, type)`` of every int or float field of the config dataclass ``cls``, nested
    tables included."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        if dataclasses.is_dataclass(t):
            yield from numeric_fields(t, f"{prefix}{f.name}.")
            continue
        args = [a for a in typing.get_args(t) if a is not type(None)] or [t]
        if args[0] in (int, float) and len(args) == 1:
            yield f"{prefix}{f.name}", args[0]


RUN_FIELDS = sorted(numeric_fields(RunConfig))
SERVE_FIELDS = sorted(set(numeric_fields(ServeConfig)) - set(RUN_FIELDS))


def test_the_walk_finds_the_fields_of_every_table():
    names = {n for n, _ in RUN_FIELDS}
    assert {"lora.r", "task.num_train", "rollout.temperature", "train.learning_rate", "gate.val_size",
            "collapse.max_rollbacks", "detectors.length_ratio", "warm_start.epochs", "distributed.num_workers",
            "sampler.timeout_s", "swap_check.probe_tokens", "iterations", "seed"} <= names
    assert {"max_batch", "port", "learner.poll_s", "max_tokens_default"} <= {n for n, _ in SERVE_FIELDS}


def huge(kind):
    return 10**30 if kind is int else 1e300


@pytest.mark.parametrize("field, kind", [f for f in RUN_FIELDS if f[0] not in THRESHOLDS], ids=lambda f: str(f))
def test_every_numeric_run_setting_refuses_a_huge_value_in_one_line(field, kind):
    value = huge(kind)
    with pytest.raises(ConfigError) as err:
        load_config(None, {field: value})
    msg = str(err.value)
    assert f"{field} must be" in msg and f"got {value!r}" in msg and "\n" not in msg, msg


@pytest.mark.parametrize("field, kind", [f for f in SERVE_FIELDS if f[0] not in THRESHOLDS], ids=lambda f: str(f))
def test_every_numeric_serve_setting_refuses_a_huge_value_in_one_line(field, kind):
    value = huge(kind)
    with pytest.raises(ConfigError) as err:
        load_serve_config(None, {field: value})
    msg = str(err.value)
    assert field.split(".")[-1] in msg and "must be" in msg and "\n" not in msg, msg


@pytest.mark.parametrize("field", sorted(THRESHOLDS))
def test_a_threshold_takes_any_finite_value(field):
    cfg = load_config(None, {field: 1e300})  # "never": accepted
    section, _, name = field.rpartition(".")
    assert getattr(getattr(cfg, section) if section else cfg, name) == 1e300


@pytest.mark.parametrize("override", [
    {"lora.r": 2048}, {"lora.lora_alpha": 4096}, {"rollout.temperature": 50.0}, {"train.learning_rate": 0.5},
    {"gate.tolerance": 1.0}, {"gate.val_size": 100_000}, {"task.num_train": 1_000_000}, {"seed": 2**62},
    {"train.beta": 100.0}, {"num_generations": 512}, {"iterations": 1_000_000}, {"rollout.max_new_tokens": 100_000},
    {"collapse.degenerate_rise": 1.0}, {"warm_start.temperature": 0.01},
])
def test_unusual_but_sane_values_still_pass(override):
    cfg = load_config(None, override)
    (field, value), = override.items()
    section, _, name = field.rpartition(".")
    assert getattr(getattr(cfg, section) if section else cfg, name) == value


@pytest.mark.parametrize("flags, line", [
    (["--lora-r", str(10**9)], "selfrl: error: lora.r must be >= 1 and <= 65536, got 1000000000"),  # tried 128 GB
    (["--val-size", str(10**9)], "selfrl: error: gate.val_size must be >= 1 and <= 100000, got 1000000000"),  # hung
    (["--temperature", "1e308"], "selfrl: error: rollout.temperature must be >= 0.0001 and <= 100, got 1e+308"),
    (["--num-prompts", str(10**9)], "selfrl: error: num_prompts must be >= 1 and <= 65536, got 1000000000"),
    (["--iterations", str(10**12)], "selfrl: error: iterations must be >= 1 and <= 10000000, got 1000000000000"),
])
def test_the_cli_refuses_an_unbounded_setting_in_one_line_before_anything_loads(flags, line, capsys, tmp_path,
                                                                                monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the setting was refused")

    monkeypatch.setattr(model_module, "load_model", refuse)
    code = main(["run", *flags, "--run-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == line


# -- bounds the model sets, read from its config before its weights load


def tiny_cfg(model_dir, **settings) -> RunConfig:
    cfg = RunConfig()
    cfg.model.name, cfg.model.device = str(model_dir), "cpu"
    for dotted, value in settings.items():
        section, _, key = dotted.rpartition("__")
        setattr(getattr(cfg, section) if section else cfg, key, value)
    return cfg


@pytest.fixture
def no_weights(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the weights were loaded before the setting was refused")

    monkeypatch.setattr(model_module, "load_model", refuse)


def test_a_lora_rank_above_the_hidden_size_is_refused_before_the_weights_load(model_dir, no_weights):
    # the tiny Phi is 32 wide
    with pytest.raises(ConfigError, match=rf"^lora.r must be <= 32 \(the hidden size of {model_dir}\), got 33$"):
        build_policy(tiny_cfg(model_dir, lora__r=33))


def test_a_token_limit_beyond_the_context_is_refused_before_the_weights_load(model_dir, no_weights):
    # the tiny Phi attends to 8192 positions
    with pytest.raises(ConfigError, match=r"^rollout.max_new_tokens must be <= 8192 \(the context length of .*\), "
                                          r"got 8193$"):
        build_policy(tiny_cfg(model_dir, rollout__max_new_tokens=8193))
    serve = ServeConfig()
    serve.model.name, serve.model.device, serve.max_tokens_default = str(model_dir), "cpu", 10_000
    with pytest.raises(ConfigError, match=r"^max_tokens_default must be <= 8192"):
        build_policy(serve)


def test_settings_at_the_models_bounds_pass(model_dir):
    model, _ = build_policy(tiny_cfg(model_dir, lora__r=32, rollout__max_new_tokens=8192))
    assert model.peft_config["default"].r == 32


def test_selfrl_run_refuses_a_rank_the_model_cannot_take_in_one_line(model_dir, capsys, tmp_path, no_weights):
    code = main(["run", "--model", str(model_dir), "--lora-r", "64", "--device", "cpu",
                 "--run-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1] == f"selfrl: error: lora.r must be <= 32 (the hidden size of {model_dir}), got 64"


def test_the_sampler_refuses_a_temperature_beyond_the_bound(tiny_model_factory, tiny_tokenizer):
    from fastapi.testclient import TestClient

    from selfrl.engines.reference import Engine
    from selfrl.serve.sampler_app import create_sampler_app

    engine = Engine(tiny_model_factory(lora=True), tiny_tokenizer)
    with TestClient(create_sampler_app(engine)) as client:
        r = client.post("/sampler/generate", json={"prompts": [[1, 2]], "max_new_tokens": 2, "temperature": 1e308})
        assert r.status_code == 400 and "temperature must be <= 100" in r.json()["detail"]
        r = client.post("/sampler/logprobs", json={"token_ids": [1, 2, 3], "temperature": 1e-300})
        assert r.status_code == 400 and "temperature" in r.json()["detail"]


@pytest.mark.parametrize("field, value", [("lora.r", 3.5), ("gate.val_size", True), ("iterations", "4"),
                                          ("distributed.num_workers", 2.0)])
def test_an_integer_setting_set_from_python_must_hold_an_integer(field, value):
    cfg = RunConfig()
    section, _, key = field.rpartition(".")
    setattr(getattr(cfg, section) if section else cfg, key, value)
    with pytest.raises(ConfigError, match=rf"^{field} must be an integer, got {value!r}$"):
        cfg.validate()

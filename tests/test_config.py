import re

import pytest

from selfrl.config import ConfigError, RunConfig, load_config
from selfrl.model.load import DEFAULT_MODEL


def test_defaults_validate():
    cfg = load_config()
    assert cfg == RunConfig().validate()
    assert cfg.model.name == DEFAULT_MODEL and cfg.num_generations == 8 and cfg.train.loss_type == "dapo"
    assert cfg.rollout.demonstration and cfg.rollout.tools == ["calculator"]


def test_toml_file_then_dotted_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(
        'iterations = 3\n'
        'run_dir = "runs/x"\n'
        '[train]\nlearning_rate = 1\nbeta = 0.0\nloss_type = "dr_grpo"\n'
        '[rollout]\ntools = []\nmax_turns = 1\n'
        '[task]\nsource = "basic_arithmetic"\noptions = {min_terms = 2}\n'
        '[lora]\ntarget_modules = ["q_proj", "v_proj"]\n'
    )
    cfg = load_config(path, {"train.beta": 0.05, "gate.val_size": 16, "num_prompts": None, "iterations": 5})
    assert cfg.iterations == 5  # the override wins over the file
    assert cfg.run_dir == "runs/x"
    assert cfg.train.learning_rate == 1.0 and isinstance(cfg.train.learning_rate, float)  # int widened
    assert cfg.train.beta == 0.05 and cfg.train.loss_type == "dr_grpo"
    assert cfg.rollout.tools == [] and cfg.rollout.max_turns == 1
    assert cfg.task.source == "basic_arithmetic" and cfg.task.options == {"min_terms": 2}
    assert cfg.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.gate.val_size == 16
    assert cfg.num_prompts == RunConfig().num_prompts  # None overrides are skipped
    assert cfg.train.epsilon == 0.2  # untouched fields keep their defaults


def test_unknown_keys_list_the_valid_ones(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key 'train\.lr'; valid: .*beta.*learning_rate"):
        load_config(overrides={"train.lr": 1e-4})
    path = tmp_path / "run.toml"
    path.write_text("[trian]\nbeta = 0.1\n")
    with pytest.raises(ConfigError, match=r"unknown key 'trian' \(did you mean 'train'\?\); valid: agent_adapters, agents, async_rollouts, collapse, detectors, distributed, engine, gate, iterations, judge, lora, model"):
        load_config(path)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"iterations": "4"}, r"iterations must be int, got '4'"),
        ({"train.beta": True}, r"train\.beta must be a number, got True"),
        ({"rollout.max_turns": 2.5}, r"rollout\.max_turns must be int, got 2\.5"),
        ({"train": 3}, r"train must be a table"),
        ({"rollout.demonstration": "yes"}, r"rollout\.demonstration must be bool, got 'yes'"),
    ],
)
def test_wrong_type_is_an_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=overrides)


def test_unreadable_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("iterations = = 3\n")
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(bad)


def test_modules_to_save_is_rejected_with_the_reason():
    with pytest.raises(ConfigError, match=r"lora\.modules_to_save is not supported: hot-swap copies LoRA tensors only"):
        load_config(overrides={"lora.modules_to_save": ["lm_head"]})


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"num_generations": 1}, r"num_generations must be >= 2 \(a group of one has no advantage\)"),
        ({"train.epsilon": 1.0}, r"train\.epsilon must be in \(0, 1\)"),
        ({"rollout.temperature": 0.0}, r"rollout\.temperature must be >= 0\.0001"),
        ({"gate.val_size": 0}, r"gate\.val_size must be >= 1"),
        ({"train.tis_cap": -1.0}, r"train\.tis_cap must be >= 0 \(0 turns the off-policy correction off\)"),
    ],
)
def test_out_of_range_values(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=overrides)


@pytest.mark.parametrize(
    "override, message",
    [
        ({"reward_weights": {"verifier": "a"}}, re.escape("reward_weights: each weight must be a number, got {'verifier': 'a'}")),
        ({"reward_weights": {"verifier": True}}, re.escape("reward_weights: each weight must be a number, got {'verifier': True}")),
        ({"reward_weights": {"verifier": float("nan")}}, re.escape("reward_weights must be finite, got {'verifier': nan}")),
        ({"reward_weights": {}}, re.escape("reward_weights = {} names no reward: leave it out to use the preset's weights")),
        ({"reward_weights": {"verifier": -1.0}}, re.escape("reward_weights: negative weight {'verifier': -1.0}: selfrl run "
                                                           "would train away from what the reward pays; use weights >= 0")),
        ({"reward_weights": {"verifier": 1.0, "length_penalty": -0.1}}, re.escape("(length_penalty's values are already negative)")),
        ({"reward_weights": {"verifier": 0.0}}, re.escape("reward_weights: {'verifier': 0.0} has no weight above 0")),
        ({"train.scale_rewards": "x"}, "train.scale_rewards"),
        ({"rollout.tools_prompt": "x"}, "rollout.tools_prompt"),
        ({"gate.batch_size": 0}, "gate.batch_size"),
        ({"task.num_train": 0}, "task.num_train"),
    ],
)
def test_values_out_of_range_fail_when_the_config_loads(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, override)


# Names that refer to registries: valid values as far as the config knows, checked at setup.
NAME_RULES = [
    # the names listed are the registry's at the time: test_unknown_reward_lists_every_registered_name
    ({"reward_weights": {"nope": 1.0}}, "unknown reward function 'nope'; valid names: agreement, "),
    ({"preset": "nope"}, "unknown reward preset 'nope'"),
    ({"rollout.tools": ["calculator", "nope"]}, "nope"),
    ({"train.loss_type": "x"}, "valid: dapo, dr_grpo, grpo"),
    ({"detectors.names": ["no_such_detector"]}, "no_such_detector"),
]


@pytest.mark.parametrize("override, message", NAME_RULES)
def test_registry_names_fail_at_setup_before_any_model_is_loaded(override, message, tmp_path, monkeypatch):
    from selfrl.run import setup
    from selfrl.run.main import run

    cfg = load_config(None, {**override, "run_dir": str(tmp_path / "run")})  # a value the config accepts
    with pytest.raises(ConfigError, match=message):
        setup.check_names(cfg)
    loaded = []
    monkeypatch.setattr(setup, "build_policy", lambda cfg: loaded.append(cfg))  # must not be reached
    with pytest.raises(ConfigError, match=message):
        run(cfg)
    assert loaded == [] and not (tmp_path / "run").exists()


def test_unknown_reward_lists_every_registered_name():
    from selfrl.envs.rewards import REWARD_FUNCS
    from selfrl.run.setup import check_names

    with pytest.raises(ConfigError) as err:
        check_names(load_config(None, {"reward_weights": {"nope": 1.0}}))
    listed = str(err.value).split("valid names: ")[1].split(", ")
    # sorted, every registered name (a test or an environment may have added some), the built-ins among them
    assert listed == sorted(REWARD_FUNCS)
    assert {"agreement", "format", "length_penalty", "partial_credit", "self_consistency", "tool_success",
            "user_correction", "user_feedback", "verifier", "web_naive", "webshop_naive"} <= set(listed)


def test_names_an_environment_registers_are_known_at_setup():
    from selfrl.run.setup import check_names

    # the web shop's preset, the code environment's tool, the repair
    # environment's detector: registered by built-in environments, which setup loads first
    cfg = load_config(None, {"preset": "webshop-naive", "rollout.tools": ["run_python"], "detectors.names": ["swe_test_edit"]})
    assert check_names(cfg) is None


def test_loading_and_validating_the_config_imports_no_environment_detector_or_reward():
    import subprocess
    import sys

    code = ("import sys, selfrl.config; selfrl.config.load_config(); import selfrl.config.serve as s; "
            "s.ServeConfig().validate(); print(sorted(m for m in sys.modules if m.startswith(('selfrl.envs', "
            "'selfrl.safety', 'selfrl.rl')) or m in ('torch', 'selfrl.envs.rewards')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_resume_may_change_iterations_but_not_the_task():
    from selfrl.config import check_resumable

    stored = load_config().to_dict()
    more = load_config(None, {"iterations": 40, "train.learning_rate": 5e-5}).to_dict()
    assert check_resumable(stored, more) is None
    other_task = load_config(None, {"task.source": "basic_arithmetic"}).to_dict()
    with pytest.raises(ConfigError, match="cannot change task"):
        check_resumable(stored, other_task)
    other_val = load_config(None, {"gate.val_size": 64}).to_dict()
    with pytest.raises(ConfigError, match="gate.val_size"):
        check_resumable(stored, other_val)
    older = {**stored, "task": {k: v for k, v in stored["task"].items() if k not in ("choice", "signal_check")}}
    assert check_resumable(older, more) is None  # a run stored before a field existed resumes with its default
    signal = load_config(None, {"task.choice": "signal"}).to_dict()
    with pytest.raises(ConfigError, match="cannot change task"):
        check_resumable(stored, signal)



def test_resume_may_change_how_the_judge_is_reached_but_not_what_it_pays():
    from selfrl.config import check_resumable

    judge = {"endpoints": [{"name": "smol", "rubric": "exact value", "deadline_s": 60.0}], "calibration": "reference"}
    stored = load_config(None, {"reward_weights": {"judge": 1.0}, "judge": judge}).to_dict()
    reached = {"endpoints": [{"name": "smol", "rubric": "exact value", "deadline_s": 300.0, "retries": 5,
                              "max_concurrency": 1, "api_key_env": "JUDGE_KEY", "price_input_per_m": 0.5}],
               "calibration": "reference", "cache": False}
    assert check_resumable(stored, load_config(None, {"reward_weights": {"judge": 1.0}, "judge": reached}).to_dict()) is None
    for changed in ({**judge, "endpoints": [{"name": "smol", "rubric": "any value"}]},
                    {**judge, "endpoints": [{"name": "smol", "rubric": "exact value", "rubric_version": "2"}]},
                    {**judge, "endpoints": [{"name": "smol", "rubric": "exact value", "mode": "pointwise"}]},
                    {**judge, "endpoints": judge["endpoints"] + [{"name": "other", "rubric": "exact value"}]},
                    {**judge, "calibration": "off"}, {**judge, "floor": "verifier"}):
        new = load_config(None, {"reward_weights": {"judge": 1.0}, "judge": changed}).to_dict()
        with pytest.raises(ConfigError, match="cannot change judge of the stored run"):
            check_resumable(stored, new)
    before_judges = {k: v for k, v in load_config().to_dict().items() if k != "judge"}  # stored before [judge] existed
    assert check_resumable(before_judges, load_config().to_dict()) is None
    with pytest.raises(ConfigError, match="cannot change reward_weights, judge"):
        check_resumable(before_judges, stored)

# Every rule of a section that `selfrl run` and `selfrl serve` share, with a value it refuses.
SHARED_RULES = [
    ("lora.modules_to_save", ["lm_head"], "lora.modules_to_save is not supported"),
    ("lora.r", 0, "lora.r must be >= 1"),
    ("lora.lora_dropout", 1.0, "lora.lora_dropout must be in"),
    ("lora.init_adapter", "/no/such/adapter", "lora.init_adapter '/no/such/adapter' is not a folder"),
    ("model.name", "", "model.name must not be empty"),
    ("task.num_train", 0, "task.num_train must be >= 1"),
    ("task.choice", "random", "task.choice must be one of 'cycle', 'signal'"),
    ("task.min_spread", 1.0, "task.min_spread must be in [0, 1)"),
    ("task.retry_after", 0, "task.retry_after must be >= 1"),
    ("task.signal_check", "loud", "task.signal_check must be one of 'warn', 'stop', 'off'"),
    ("rollout.temperature", 0.0, "rollout.temperature must be >= 0.0001"),
    ("rollout.max_turns", 0, "rollout.max_turns must be >= 1"),
    ("rollout.max_new_tokens", 0, "rollout.max_new_tokens must be >= 1"),
    ("rollout.tools_prompt", "xml", "rollout.tools_prompt must be one of 'compact', 'json'"),
    ("train.learning_rate", 0.0, "train.learning_rate must be > 0"),
    ("train.beta", -1.0, "train.beta must be >= 0"),
    ("train.epsilon", 1.5, "train.epsilon must be in"),
    ("train.epsilon_high", -0.1, "train.epsilon_high must be > 0"),
    ("train.num_iterations", 0, "train.num_iterations must be >= 1"),
    ("train.micro_batch_size", 0, "train.micro_batch_size must be >= 1"),
    ("train.max_grad_norm", 0.0, "train.max_grad_norm must be > 0"),
    ("train.weight_decay", -1.0, "train.weight_decay must be >= 0"),
    ("train.scale_rewards", "batch", "train.scale_rewards must be one of 'group', 'none'"),
    ("train.skip_max_reward_spread", 0.0, "train.skip_max_reward_spread must be > 0"),
    ("train.skip_max_kl", 0.0, "train.skip_max_kl must be > 0"),
    ("train.skip_max_grad_norm", 0.0, "train.skip_max_grad_norm must be > 0"),
    ("gate.val_size", 0, "gate.val_size must be >= 1"),
    ("gate.eval_every", 0, "gate.eval_every must be >= 1"),
    ("gate.tolerance", -0.1, "gate.tolerance must be >= 0"),
    ("gate.batch_size", 0, "gate.batch_size must be >= 1"),
    ("collapse.kl_probe_size", -1, "collapse.kl_probe_size must be >= 0"),
    ("collapse.baseline_window", 0, "collapse.baseline_window must be >= 1"),
    ("collapse.entropy_min_ratio", 1.0, "collapse.entropy_min_ratio must be in [0, 1)"),
    ("collapse.entropy_max_ratio", 0.5, "collapse.entropy_max_ratio must be > 1"),
    ("collapse.max_kl", 0.0, "collapse.max_kl must be > 0"),
    ("collapse.degenerate_rise", 0.0, "collapse.degenerate_rise must be > 0"),
    ("collapse.heldout_drop", 0.0, "collapse.heldout_drop must be > 0"),
    ("collapse.max_rollbacks", -1, "collapse.max_rollbacks must be >= 0"),
    ("collapse.lr_factor", 2.0, "collapse.lr_factor must be in"),
    ("collapse.beta_factor", 0.5, "collapse.beta_factor must be >= 1"),
    ("collapse.beta_min", -1.0, "collapse.beta_min must be >= 0"),
    ("collapse.beta_min", 2.0, "collapse.beta_min (2) must be at most collapse.beta_max (1): lower the first or "
     "raise the second"),
    ("collapse.beta_max", 0.001, "collapse.beta_min (0.01) must be at most collapse.beta_max (0.001)"),
    ("collapse.lr_floor", 0.01, "collapse.lr_floor (0.01) must be at most train.learning_rate (0.0001)"),
    ("collapse.repeat_ngram", 0, "collapse.repeat_ngram must be >= 1"),
    ("collapse.repeat_share", 0.0, "collapse.repeat_share must be in (0, 1]"),
]
# Every shared section's registry names, with one its registry does not know.
SHARED_NAME_RULES = [
    ("rollout.tools", ["calculator", "nope"], "nope"),
    ("train.loss_type", "x", "valid: dapo, dr_grpo, grpo"),
    ("detectors.names", ["no_such_detector"], "no_such_detector"),
]


@pytest.mark.parametrize("key, value, message", SHARED_RULES, ids=[r[0] for r in SHARED_RULES])
def test_a_shared_rule_refuses_the_same_value_in_run_and_serve(key, value, message):
    from selfrl.serve.main import load_serve_config

    with pytest.raises(ConfigError) as run_err:
        load_config(None, {key: value})
    with pytest.raises(ConfigError) as serve_err:
        load_serve_config(None, {key: value})
    assert message in str(run_err.value)
    assert str(serve_err.value) == str(run_err.value)


@pytest.mark.parametrize("key, value, message", SHARED_NAME_RULES, ids=[r[0] for r in SHARED_NAME_RULES])
def test_a_shared_name_is_refused_the_same_at_the_setup_of_run_and_serve(key, value, message):
    from selfrl.run.setup import check_names
    from selfrl.serve.main import load_serve_config

    run_cfg, serve_cfg = load_config(None, {key: value}), load_serve_config(None, {key: value})
    with pytest.raises(ConfigError) as run_err:
        check_names(run_cfg)
    with pytest.raises(ConfigError) as serve_err:
        check_names(serve_cfg, serve_cfg.learner.reward_weights)
    assert message in str(run_err.value)
    assert str(serve_err.value) == str(run_err.value)


def test_the_rules_walked_cover_every_shared_section_and_serve_holds_them_all():
    import dataclasses

    from selfrl.config import SHARED_SECTIONS
    from selfrl.config.serve import ServeConfig

    assert {key.split(".")[0] for key, _, _ in SHARED_RULES + SHARED_NAME_RULES} == set(SHARED_SECTIONS)
    run_types = {f.name: f.type for f in dataclasses.fields(RunConfig)}
    serve_types = {f.name: f.type for f in dataclasses.fields(ServeConfig)}
    assert all(serve_types[name] == run_types[name] for name in SHARED_SECTIONS)


def test_importing_the_config_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, selfrl.config, selfrl.config.serve; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("key", ["train.learning_rate", "rollout.temperature", "gate.tolerance", "collapse.max_kl"])
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_a_number_that_is_not_finite_is_refused_in_run_and_serve(key, value):
    from selfrl.serve.main import load_serve_config

    for load in (load_config, load_serve_config):
        with pytest.raises(ConfigError, match=f"{key} must be a finite number"):
            load(None, {key: value})

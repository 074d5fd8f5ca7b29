import pytest

from selfrl.config import ConfigError, RunConfig, load_config
from selfrl.model import DEFAULT_MODEL


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
    with pytest.raises(ConfigError, match=r"unknown key train\.'lr'; valid: .*beta.*learning_rate"):
        load_config(overrides={"train.lr": 1e-4})
    path = tmp_path / "run.toml"
    path.write_text("[trian]\nbeta = 0.1\n")
    with pytest.raises(ConfigError, match=r"unknown key 'trian'; valid: collapse, detectors, engine, gate, iterations, lora, model"):
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
        ({"rollout.temperature": 0.0}, r"rollout\.temperature must be > 0"),
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
        ({"reward_weights": {"verifier": "a"}}, "finite"),
        ({"reward_weights": {"nope": 1.0}}, "valid names: agreement, format, length_penalty, partial_credit, self_consistency, tool_success, user_correction, verifier"),
        ({"train.scale_rewards": "x"}, "train.scale_rewards"),
        ({"rollout.tools_prompt": "x"}, "rollout.tools_prompt"),
        ({"rollout.tools": ["calculator", "nope"]}, "nope"),
        ({"gate.batch_size": 0}, "gate.batch_size"),
        ({"task.num_train": 0}, "task.num_train"),
        ({"train.loss_type": "x"}, "valid: dapo, dr_grpo, grpo"),
    ],
)
def test_registry_names_and_ranges_fail_before_any_model_is_loaded(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, override)


def test_resume_may_change_iterations_but_not_the_task():
    from selfrl.loop import check_resumable

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

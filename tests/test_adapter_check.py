"""Adapters selfrl cannot train and hot-swap are refused wherever they come in, before any
training and before the base weights load (selfrl.model.adapter_check)."""

from __future__ import annotations

import json
import socket

import pytest
import torch

from selfrl.record import adapters
from selfrl.model import load as model_module
from selfrl.model.adapter_check import AdapterError, check_adapter
from selfrl.cli import main
from selfrl.config import RunConfig
from selfrl.model.load import build_policy


def cfg_for(model_dir, run_dir=None, **lora) -> RunConfig:
    cfg = RunConfig(iterations=1, num_prompts=2, num_generations=2, run_dir=str(run_dir or "unused"))
    cfg.model.name, cfg.model.device, cfg.lora.r, cfg.lora.lora_alpha = str(model_dir), "cpu", 4, 8
    for k, v in lora.items():
        setattr(cfg.lora, k, v)
    return cfg


def save_adapter(model_dir, folder, peft_config):
    """``peft_config`` applied to the tiny Phi of ``model_dir`` and saved to ``folder`` as peft saves it."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir)
    get_peft_model(base, peft_config).save_pretrained(folder)
    return folder


def lora_config(**kw):
    from peft import LoraConfig

    return LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": "all-linear", "task_type": "CAUSAL_LM", **kw})


@pytest.fixture
def no_weights(monkeypatch):
    """Fail the test if the base model's weights are loaded: refusals come before that."""
    def refuse(*a, **k):
        raise AssertionError("the base weights were loaded before the adapter was refused")

    monkeypatch.setattr(model_module, "load_model", refuse)


REFUSED = {
    "modules_to_save": lambda: lora_config(modules_to_save=["lm_head"]),  # issue 37 case 5
    "trainable_token_indices": lambda: lora_config(trainable_token_indices=[1, 2]),
    "use_dora": lambda: lora_config(use_dora=True),
    "lora_bias": lambda: lora_config(lora_bias=True),
    "bias": lambda: lora_config(bias="all"),
    "peft_type": lambda: __import__("peft").IA3Config(target_modules=["fc2"], feedforward_modules=["fc2"],
                                                      task_type="CAUSAL_LM"),
    "target_modules": lambda: lora_config(target_modules=["q_proj", "embed_tokens"]),
}


@pytest.mark.parametrize("option", sorted(REFUSED))
def test_an_init_adapter_that_trains_more_than_lora_is_refused_before_the_weights_load(option, model_dir, tmp_path,
                                                                                       monkeypatch):
    folder = save_adapter(model_dir, tmp_path / "adapter", REFUSED[option]())
    cfg = cfg_for(model_dir, init_adapter=str(folder))

    def refuse(*a, **k):
        raise AssertionError("the base weights were loaded before the adapter was refused")

    monkeypatch.setattr(model_module, "load_model", refuse)
    with pytest.raises(AdapterError, match=f"lora.init_adapter {folder}: {option}") as err:
        build_policy(cfg)
    assert "\n" not in str(err.value)
    if option != "peft_type":
        assert "merge_and_unload" in str(err.value)  # says what to do


def test_selfrl_run_with_an_adapter_that_trains_the_output_layer_exits_2_before_training(model_dir, tmp_path, capsys,
                                                                                        no_weights):
    # the field case: it trained and exited 0
    folder = save_adapter(model_dir, tmp_path / "adapter", lora_config(modules_to_save=["lm_head"]))
    config = tmp_path / "run.toml"
    config.write_text(f"[lora]\nr = 4\nlora_alpha = 8\ninit_adapter = {json.dumps(str(folder))}\n"
                      "[task]\nnum_train = 10\n[gate]\nval_size = 2\n")
    capsys.readouterr()
    code = main(["run", "--config", str(config), "--model", str(model_dir), "--run-dir", str(tmp_path / "r"),
                 "--device", "cpu"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith(f"selfrl: error: lora.init_adapter {folder}: modules_to_save = [\"lm_head\"] is not "
                          "supported") and len(err.splitlines()) == 1
    assert not (tmp_path / "r" / "adapters").exists()  # nothing trained or saved


def test_selfrl_serve_refuses_the_same_starting_adapter(model_dir, tmp_path, capsys, no_weights):
    folder = save_adapter(model_dir, tmp_path / "adapter", lora_config(modules_to_save=["lm_head"]))
    config = tmp_path / "serve.toml"
    config.write_text(f"[lora]\nr = 4\nlora_alpha = 8\ninit_adapter = {json.dumps(str(folder))}\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    capsys.readouterr()
    code = main(["serve", "--config", str(config), "--model", str(model_dir), "--run-dir", str(tmp_path / "s"),
                 "--port", str(port), "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith(f"selfrl: error: lora.init_adapter {folder}: modules_to_save")


def test_a_stored_version_that_trains_the_output_layer_is_refused_when_loaded(model_dir, tmp_path):
    # a resumed run's champion, a pinned version, a folder pushed to `selfrl sampler`: all go
    # through load_version_state (and Engine.swap through it), which refuses it whole
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from selfrl.engines.reference import Engine
    from selfrl.serve.sampler_app import create_sampler_app

    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), lora_config(modules_to_save=["lm_head"]))
    path = adapters.save_version(peft_model, tmp_path / "run", 3)
    assert adapters.verify_version(path) is None  # complete and intact: refused for what it is
    with pytest.raises(AdapterError, match="modules_to_save"):
        adapters.load_version_state(path)
    policy, tok = build_policy(cfg_for(model_dir))
    engine = Engine(policy, tok)
    before = {k: v.clone() for k, v in engine.lora_parameters().items()}
    with pytest.raises(AdapterError, match="modules_to_save"):
        engine.swap(path, 3)
    assert engine.version == 0 and all(torch.equal(v, before[k]) for k, v in engine.lora_parameters().items())
    from fastapi.testclient import TestClient

    with TestClient(create_sampler_app(engine)) as client:
        r = client.post("/sampler/adapters/3/load", json={"path": str(path)})
    assert r.status_code == 400 and "modules_to_save" in r.json()["detail"]


def test_an_adapter_of_another_base_model_is_refused(model_dir, tmp_path, no_weights):
    folder = save_adapter(model_dir, tmp_path / "adapter", lora_config())
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(model_dir)
    config["base_model_name_or_path"] = "Qwen/Qwen2.5-0.5B-Instruct"
    (folder / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(AdapterError, match="it was trained on 'Qwen/Qwen2.5-0.5B-Instruct', but model.name is"):
        build_policy(cfg_for(model_dir, init_adapter=str(folder)))


@pytest.mark.parametrize("setting, value, message", [
    ("r", 8, "the adapter has r = 4 but lora.r is 8; set lora.r = 4"),
    ("lora_alpha", 32, "the adapter has lora_alpha = 8 but lora.lora_alpha is 32; set lora.lora_alpha = 8"),
    ("lora_dropout", 0.1, "the adapter has lora_dropout = 0.0 but lora.lora_dropout is 0.1"),
    ("target_modules", ["q_proj"], r"the adapter's target_modules are \['k_proj', 'q_proj'\] but "
                                   r"lora.target_modules is \['q_proj'\]"),
])
def test_lora_settings_that_the_init_adapter_would_silently_override_are_refused(setting, value, message, model_dir,
                                                                               tmp_path, no_weights):
    folder = save_adapter(model_dir, tmp_path / "adapter", lora_config(target_modules=["q_proj", "k_proj"]))
    cfg = cfg_for(model_dir, init_adapter=str(folder), target_modules=["q_proj", "k_proj"])
    setattr(cfg.lora, setting, value)
    with pytest.raises(AdapterError, match=message):
        build_policy(cfg)


def test_an_init_adapter_narrower_than_all_linear_is_refused_and_accepted_when_named(model_dir, tmp_path):
    folder = save_adapter(model_dir, tmp_path / "adapter", lora_config(target_modules=["q_proj", "v_proj"]))
    with pytest.raises(AdapterError, match=r"no LoRA on dense, fc1, fc2, k_proj, but lora.target_modules is "
                                           r"\"all-linear\"; set lora.target_modules = \[\"q_proj\", \"v_proj\"\]"):
        build_policy(cfg_for(model_dir, init_adapter=str(folder)))
    model, _ = build_policy(cfg_for(model_dir, init_adapter=str(folder), target_modules=["v_proj", "q_proj"]))
    assert sorted({k.split(".")[-3] for k in adapters.lora_state(model)}) == ["q_proj", "v_proj"]


def test_a_plain_lora_adapter_is_accepted_and_loaded(model_dir, tmp_path):
    from peft import get_peft_model_state_dict

    folder = save_adapter(model_dir, tmp_path / "adapter", lora_config(init_lora_weights=False))
    assert check_adapter(folder, str(model_dir))["r"] == 4
    model, _ = build_policy(cfg_for(model_dir, init_adapter=str(folder)))
    from safetensors.torch import load_file

    saved = load_file(str(folder / "adapter_model.safetensors"))
    state = get_peft_model_state_dict(model)
    assert state.keys() == saved.keys() and all(torch.equal(state[k], saved[k]) for k in saved)


@pytest.mark.parametrize("targets, layer", [(["q_proj", "lm_head"], r"lm_head \(Linear\)"),
                                            (r".*(q_proj|embed_tokens)", r"model.embed_tokens \(Embedding\)")])
def test_the_embedding_or_output_layer_in_target_modules_is_refused_before_training(targets, layer, model_dir):
    # by name or by a regular expression: the built model is checked before anything trains
    with pytest.raises(AdapterError, match=f"LoRA on {layer} is not supported"):
        build_policy(cfg_for(model_dir, target_modules=targets))


def test_a_folder_without_an_adapter_config_is_refused(tmp_path):
    (tmp_path / "a").mkdir()
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        check_adapter(tmp_path / "a")
    (tmp_path / "a" / "adapter_config.json").write_text("[1]")
    with pytest.raises(AdapterError, match="not a JSON object"):
        check_adapter(tmp_path / "a")

"""``benchmarks/trl_setup.py``, the TRL side of the TRL comparison: the GRPO and LoRA settings it
builds from a run config (recorded by stand-in ``trl``/``peft`` modules, TRL being an optional
extra) and its per-step timeline."""

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))


class _Recorder:
    """Stands in for a TRL or peft class: keeps the keyword arguments it was built with."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs


@pytest.fixture
def fake_trl(monkeypatch):
    """``trl`` and ``peft`` modules whose classes record their arguments (TRL is an optional extra)."""
    import types

    trl_mod, peft_mod = types.ModuleType("trl"), types.ModuleType("peft")
    trl_mod.GRPOConfig = type("GRPOConfig", (_Recorder,), {})
    trl_mod.GRPOTrainer = type("GRPOTrainer", (_Recorder,), {})
    peft_mod.LoraConfig = type("LoraConfig", (_Recorder,), {})
    monkeypatch.setitem(sys.modules, "trl", trl_mod)
    monkeypatch.setitem(sys.modules, "peft", peft_mod)


def test_trl_setup_builds_grpo_and_lora_from_the_run_config(tmp_path, fake_trl):
    """Both TRL benchmarks train with these settings (bench_trl.py and bench_trl_demo.py)."""
    import torch
    import trl_setup

    from selfrl.config import load_config

    cfg = load_config(BENCH.parent / "configs" / "demo.toml", {"run_dir": str(tmp_path), "num_prompts": 4,
                                                               "num_generations": 6, "train.micro_batch_size": 8})
    args = trl_setup.grpo_args(cfg, gradient_checkpointing=False, max_steps=7)
    t = cfg.train
    assert args.kwargs == {
        "output_dir": str(tmp_path / "trainer"), "use_cpu": True, "bf16": False, "fp16": False,
        "gradient_checkpointing": False, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 3,
        "num_generations": 6, "max_completion_length": cfg.rollout.max_new_tokens,
        "temperature": cfg.rollout.temperature, "top_k": 0, "top_p": 1.0, "learning_rate": t.learning_rate,
        "lr_scheduler_type": "constant", "warmup_steps": 0, "weight_decay": t.weight_decay,
        "max_grad_norm": t.max_grad_norm, "beta": t.beta, "epsilon": t.epsilon, "loss_type": t.loss_type,
        "scale_rewards": t.scale_rewards, "num_iterations": t.num_iterations, "max_steps": 7,
        "shuffle_dataset": False, "seed": cfg.seed, "disable_dropout": True, "report_to": "none",
        "logging_steps": 1, "save_strategy": "no", "optim": "adamw_torch", "dataloader_num_workers": 0}
    cfg.train.micro_batch_size = 5  # 24 completions per update are not whole micro-batches of 5
    with pytest.raises(ValueError, match=r"num_prompts x num_generations \(24\) must be a multiple of "
                                         r"train.micro_batch_size \(5\)"):
        trl_setup.grpo_args(cfg, gradient_checkpointing=False, max_steps=7)

    def reward(prompts, completions, **kw):
        return [0.0] * len(completions)

    torch.manual_seed(cfg.seed)
    expected = torch.rand(1)
    trainer = trl_setup.grpo_trainer(cfg, "model", "tok", reward, args, ["data"], "callback")
    assert torch.rand(1) == expected  # seeded with cfg.seed just before
    k = trainer.kwargs
    assert (k["model"], k["reward_funcs"], k["args"], k["train_dataset"], k["processing_class"], k["callbacks"]) == \
        ("model", [reward], args, ["data"], "tok", ["callback"])
    assert k["peft_config"].kwargs == {"r": cfg.lora.r, "lora_alpha": cfg.lora.lora_alpha,
                                       "lora_dropout": cfg.lora.lora_dropout,
                                       "target_modules": cfg.lora.target_modules, "task_type": "CAUSAL_LM"}


def test_trl_step_timeline_saves_every_step_and_stops_past_the_budget(tmp_path, monkeypatch):
    import types

    import trl_setup

    clock = iter([0.0, 10.0, 12.0, 30.0, 31.0])  # begin; step 1 ends at 10, saved by 12; step 2 at 30, saved by 31
    monkeypatch.setattr(trl_setup.time, "perf_counter", lambda: next(clock))
    saved = []
    model = types.SimpleNamespace(save_pretrained=saved.append)
    control = types.SimpleNamespace(should_training_stop=False)
    timeline = trl_setup.step_timeline(tmp_path, 5, budget_s=15.0)
    timeline.on_train_begin(None, None, control)
    for step in (1, 2):
        timeline.on_step_end(None, types.SimpleNamespace(global_step=step), control, model=model)
        assert control.should_training_stop is (step == 2)  # 10 s < 15 s; then 30 - 2 s of saving = 28 s
    assert saved == [tmp_path / "step00001", tmp_path / "step00002"]
    assert timeline.steps == [{"step": 1, "seconds": 10.0, "adapter": str(tmp_path / "step00001")},
                              {"step": 2, "seconds": 28.0, "adapter": str(tmp_path / "step00002")}]

    clock = iter([0.0, 10.0, 12.0, 30.0, 31.0])
    detailed = trl_setup.step_timeline(tmp_path, 4, details=True)
    detailed.on_train_begin(None, None, control)
    for step in (1, 2):
        detailed.on_step_end(None, types.SimpleNamespace(global_step=step), control, model=model)
    assert [(s["adapter"], s["seconds"], s["step_s"]) for s in detailed.steps] == \
        [(str(tmp_path / "step0001"), 10.0, 10.0), (str(tmp_path / "step0002"), 28.0, 18.0)]
    assert all(s["cpu_s"] >= 0 and s["loadavg"] >= 0 for s in detailed.steps)

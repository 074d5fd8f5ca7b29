"""Device and dtype placement (selfrl.model.device): the same tests on every device this
machine has (the CPU always, CUDA when a GPU is visible), and the refusals of
impossible settings checked with the GPU hidden.
"""

import pytest
import torch
from conftest import add_lora, build_tiny_model, save_tiny_phi

from selfrl.model import device as dev
from selfrl.record.adapters import lora_state
from selfrl.cli import main
from selfrl.config import ConfigError, RunConfig
from selfrl.engines.reference import Engine
from selfrl.model.load import build_policy
from selfrl.rl.batch import collate
from selfrl.rl.logprobs import per_token_logps, tree_supported
from selfrl.rollout.agent import RolloutConfig, rollout
from selfrl.core.tasks import Task
from selfrl.core.tools import CALCULATOR
from selfrl.rl.learner import Learner, TrainConfig

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
TEMPERATURE = 0.7
TASKS = [Task.make("test", "What is 17+25?", "42"), Task.make("test", "What is 2+2?", "4")]


def policy(tok, device, dtype=torch.float32, seed=3):
    """The tiny Llama with peft's default LoRA init (B = 0), base weights in ``dtype``, on ``device``."""
    base = build_tiny_model(tok, seed=seed, eos_bias=2.5).to(dtype)
    return add_lora(base, seed=seed + 1, default_init=True).to(device)


def sample(model, tok, seed=0):
    engine = Engine(model, tok)
    cfg = RolloutConfig(max_turns=2, max_new_tokens=12, temperature=TEMPERATURE)
    tasks = [t for t in TASKS for _ in range(3)]
    torch.manual_seed(seed)
    trajs = rollout(engine, tasks, [t.id for t in tasks], [CALCULATOR], cfg)
    for i, t in enumerate(trajs):
        t.advantage = 1.0 if i % 2 == 0 else -1.0
    return trajs


def learner(model, tok, **kw):
    cfg = TrainConfig(**{"beta": 0.0, "micro_batch_size": 4, "learning_rate": 1e-2, **kw})
    return Learner(model, cfg, TEMPERATURE, tok.pad_token_id, max_completion_length=24)


@pytest.fixture
def no_gpu(monkeypatch):
    """This process sees no CUDA device."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


# ------------------------------------------------------------------ resolution


def test_defaults_resolve_to_cpu_float32_without_a_gpu(no_gpu):
    assert dev.resolve() == dev.Placement("cpu", "float32")
    assert dev.resolve("cpu", "bfloat16") == dev.Placement("cpu", "bfloat16")  # asked for: honoured, not replaced


def test_auto_picks_cuda_and_bf16_only_where_the_gpu_has_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert dev.resolve() == dev.Placement("cuda", "bfloat16")
    assert dev.resolve("cpu") == dev.Placement("cpu", "float32")  # fp32 stays the CPU default
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla V100")
    assert dev.resolve() == dev.Placement("cuda", "float32")
    with pytest.raises(dev.DeviceError, match="Tesla V100 has no bf16 support"):
        dev.resolve("cuda", "bfloat16")


def test_cuda_without_a_gpu_is_refused_by_resolve_config_and_cli(no_gpu, capsys, tmp_path):
    with pytest.raises(dev.DeviceError, match="model.device = 'cuda' but .*use --device cpu or auto"):
        dev.resolve("cuda")
    cfg = RunConfig()
    cfg.model.device = "cuda"
    with pytest.raises(ConfigError, match="model.device = 'cuda'"):
        cfg.validate()
    assert main(["run", "--device", "cuda", "--run-dir", str(tmp_path / "r")]) == 2
    assert "selfrl: error: model.device = 'cuda' but" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()  # refused before anything was written


def test_a_cpu_only_engine_is_refused_on_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    cfg = RunConfig(engine="slots")
    with pytest.raises(ConfigError, match="engine 'slots' runs on the CPU only.*'cuda'"):
        cfg.validate()
    cfg.model.device = "cpu"
    assert cfg.validate() is cfg


@pytest.mark.parametrize("field, value, message", [
    ("device", "tpu", "model.device must be one of auto, cpu, cuda, got 'tpu'"),
    ("dtype", "float16", "float16 is not supported: use bfloat16"),
    ("dtype", "int8", "model.dtype must be one of auto, float32, bfloat16"),
])
def test_unknown_device_or_dtype_names_are_refused(field, value, message):
    cfg = RunConfig()
    setattr(cfg.model, field, value)
    with pytest.raises(ConfigError, match=message):
        cfg.validate()


def test_cli_flags_reach_the_config(no_gpu, tmp_path, monkeypatch):
    seen = {}

    def fake_run(cfg, resume, progress):
        seen["cfg"] = cfg
        raise ValueError("stop here")

    monkeypatch.setattr("selfrl.run.main.run", fake_run)
    assert main(["run", "--device", "cpu", "--dtype", "bfloat16", "--gradient-checkpointing",
                 "--run-dir", str(tmp_path / "r")]) == 2
    cfg = seen["cfg"]
    assert (cfg.model.device, cfg.model.dtype, cfg.train.gradient_checkpointing) == ("cpu", "bfloat16", True)
    main(["run", "--run-dir", str(tmp_path / "r2")])
    assert (seen["cfg"].model.device, seen["cfg"].model.dtype, seen["cfg"].train.gradient_checkpointing) == (
        "auto", "auto", False)


# ------------------------------------------------------------------ on each device


@pytest.mark.parametrize("device", DEVICES)
def test_build_policy_places_the_model_and_seeds_the_adapter_as_on_the_cpu(tmp_path, tiny_tokenizer, device):
    folder = save_tiny_phi(tmp_path / "m", tiny_tokenizer)
    cfg = RunConfig()
    cfg.model.name, cfg.lora.r, cfg.model.device, cfg.model.dtype = str(folder), 4, "cpu", "bfloat16"
    cpu_model, _ = build_policy(cfg)
    cfg.model.device = device
    model, _ = build_policy(cfg)
    assert {p.device.type for p in model.parameters()} == {device}
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert {d for n, d in dtypes.items() if "lora_" in n} == {torch.float32}  # the adapter stays fp32
    assert {d for n, d in dtypes.items() if "lora_" not in n} == {torch.bfloat16}
    # the LoRA init ran on the CPU generator before the move: the same adapter on every device
    # (peft draws it in the base layer's dtype, so compare like with like: bf16 on the CPU)
    for key, value in lora_state(cpu_model).items():
        torch.testing.assert_close(lora_state(model)[key].cpu(), value, atol=0, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_sampled_logprobs_equal_recomputed_on_device(tiny_tokenizer, device):
    model = policy(tiny_tokenizer, device)
    trajs = sample(model, tiny_tokenizer)
    assert sum(t.num_completion_tokens for t in trajs) > len(trajs)
    mb = collate(trajs, tiny_tokenizer.pad_token_id).to(device)
    with torch.no_grad():
        got = per_token_logps(model, mb.input_ids, mb.attention_mask, mb.completion_mask, TEMPERATURE)  # (B, T)
    m = mb.completion_mask.bool()
    torch.testing.assert_close(got[m], mb.old_per_token_logps[m], atol=1e-4, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_update_on_device_equals_the_update_on_the_cpu(tiny_tokenizer, device):
    cpu_model, dev_model = policy(tiny_tokenizer, "cpu"), policy(tiny_tokenizer, device)
    trajs = sample(cpu_model, tiny_tokenizer)
    m_cpu = learner(cpu_model, tiny_tokenizer).step(trajs).metrics()
    m_dev = learner(dev_model, tiny_tokenizer).step(trajs).metrics()
    assert m_dev["skipped"] == 0.0 and m_dev["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert m_dev["loss"] == pytest.approx(m_cpu["loss"], abs=1e-5)
    key = "memory/peak_cuda_bytes" if device == "cuda" else "memory/peak_rss_bytes"
    assert m_dev[key] > 0
    moved = 0
    for k, v in lora_state(cpu_model).items():
        got = lora_state(dev_model)[k].cpu()
        torch.testing.assert_close(got, v, atol=1e-5, rtol=0)
        moved += int("lora_B" in k and bool(got.any()))
    assert moved == 14  # every B left zero after the first step (7 linear layers x 2 decoder layers)


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_base_trains_the_fp32_adapter_and_leaves_the_base(tiny_tokenizer, device):
    model = policy(tiny_tokenizer, device, dtype=torch.bfloat16)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    trajs = sample(model, tiny_tokenizer)
    m = learner(model, tiny_tokenizer).step(trajs).metrics()
    assert m["skipped"] == 0.0 and torch.isfinite(torch.tensor(m["loss"]))
    # bf16 sampling and bf16 recomputation differ in rounding only: the ratio stays near 1
    assert m["ratio_mean"] == pytest.approx(1.0, abs=0.05)
    params = dict(model.named_parameters())
    assert all(torch.equal(v, params[n]) for n, v in base.items())
    assert all(p.dtype == torch.float32 for n, p in params.items() if "lora_" in n)
    assert sum(bool(p.any()) for n, p in params.items() if "lora_B" in n) == 14


@pytest.mark.parametrize("device", DEVICES)
def test_gradient_checkpointing_recomputes_and_gives_the_same_update(tiny_tokenizer, device):
    plain, ckpt = policy(tiny_tokenizer, device), policy(tiny_tokenizer, device)
    trajs = sample(plain, tiny_tokenizer)
    shapes = {"plain": [], "ckpt": []}  # (rows, positions) of each pass through the first decoder layer's MLP
    for name, model in (("plain", plain), ("ckpt", ckpt)):
        # the packed tree's one-time check of this decoder (two short passes) done before counting
        assert tree_supported(model.get_base_model().model, torch.ones((2, 4), dtype=torch.long))
        mlp = model.get_base_model().model.layers[0].mlp

        def counted(x, forward=mlp.forward, name=name):  # not a hook: the recomputation runs no module hooks
            shapes[name].append(tuple(x.shape[:2]))
            return forward(x)

        mlp.forward = counted
    m_plain = learner(plain, tiny_tokenizer).step(trajs).metrics()
    lr = learner(ckpt, tiny_tokenizer, gradient_checkpointing=True)
    assert dev.gradient_checkpointing_on(ckpt)
    m_ckpt = lr.step(trajs).metrics()
    # 6 sequences in micro-batches of 4 and 2. Without checkpointing: a shared-prefix pass (1 row) and a
    # suffix pass per micro-batch (for this tiny model, hidden size 32, a packed tree's dense attention costs
    # more than it saves: selfrl.rl.tree.tree_pays). With it the cache is dropped, so the rows would be
    # encoded whole, and the packed tree (one row of its nodes) is cheaper: run again in the backward pass.
    assert [rows for rows, _ in shapes["plain"]] == [1, 4, 1, 2]
    a, b = shapes["ckpt"][0], shapes["ckpt"][2]
    assert shapes["ckpt"] == [a, a, b, b] and (a[0], b[0]) == (1, 1)
    assert m_ckpt["loss"] == pytest.approx(m_plain["loss"], abs=1e-6)
    # AdamW's first step moves each weight by about lr = 1e-2 whatever the gradient's size, so a
    # summation-order difference in a near-zero gradient shows up amplified (8e-6 seen on a 16-core CPU)
    for k, v in lora_state(plain).items():
        torch.testing.assert_close(lora_state(ckpt)[k], v, atol=1e-4, rtol=0)
    # generation is unaffected: the engine still decodes with its KV cache in eval mode
    assert Engine(ckpt, tiny_tokenizer).generate([[1, 2, 3]], max_new_tokens=4, greedy=True)[0].token_ids

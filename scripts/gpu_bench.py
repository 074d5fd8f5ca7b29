"""GPU checks in one process: seconds per update and peak memory of
the learner (fp32 against bf16, with and without gradient checkpointing) on a randomly
initialised model of Qwen2.5-0.5B's shape, sampling speed, and short ``selfrl run``s
through the CLI on CUDA in bf16 with gradient checkpointing (the tiny test model and
the 0.5B-shaped one).

No model hub: the models are built from configs with random weights, and the tokenizer
is the tests' tiny one (ids beyond its vocabulary decode to nothing). The reward of the
runs is the share of even token ids in the completion, which varies between samples of
a random model, so that updates have a signal.

    python scripts/gpu_bench.py --out DIR [--quick]

Writes DIR/bench.json and prints one line per measurement.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

SMALL = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True)
DEVICE = "cuda"
QWEN05 = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
              num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
              tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1000000.0)


SHAPE, MODEL_NAME = QWEN05, "qwen2.5-0.5b-shape (random)"


_BUILT: dict = {}


def qwen05(tok, dtype=torch.float32):
    """A fresh copy of one random model of ``SHAPE`` (built once: a 0.5B init takes seconds)."""
    import copy

    from transformers import Qwen2Config, Qwen2ForCausalLM

    if "model" not in _BUILT:
        cfg = Qwen2Config(**SHAPE, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id, bos_token_id=None)
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(cfg)
        model.generation_config.eos_token_id = tok.eos_token_id
        model.generation_config.pad_token_id = tok.eos_token_id
        _BUILT["model"] = model.eval()
    return copy.deepcopy(_BUILT["model"]).to(dtype)


def with_lora(model, r=16):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=r, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")).eval()


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def synthetic(model, n=32, prompt=64, completion=192):
    """``n`` trajectories of random ids with recorded logprobs equal to the policy's (ratio 1)."""
    from selfrl.rl.batch import collate
    from selfrl.rl.logprobs import per_token_logps
    from selfrl.core.trajectory import Trajectory

    vocab = SHAPE["vocab_size"]
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(0, vocab, (prompt,), generator=g).tolist()  # one system prompt, as in a run
    trajs = []
    for i in range(n):
        ids = shared + torch.randint(0, vocab, (completion,), generator=g).tolist()
        t = Trajectory(f"t{i}", f"g{i // 8}", 0, token_ids=ids, completion_mask=[0] * prompt + [1] * completion,
                       logprobs=[0.0] * (prompt + completion), reward=float(i % 2), advantage=1.0 if i % 2 else -1.0)
        trajs.append(t)
    dev = next(model.parameters()).device
    for i in range(0, n, 8):
        mb = collate(trajs[i:i + 8], 0).to(dev)
        with torch.no_grad():
            lp = per_token_logps(model, mb.input_ids, mb.attention_mask, mb.completion_mask, 1.0)
        for j, t in enumerate(trajs[i:i + 8]):
            t.logprobs = lp[j].tolist()
    return trajs


def bench_learner(tok, dtype, checkpointing, steps=3):
    from selfrl.rl.learner import Learner, TrainConfig

    model = with_lora(qwen05(tok, dtype)).to(DEVICE)
    trajs = synthetic(model)
    cfg = TrainConfig(beta=0.02, micro_batch_size=8, learning_rate=1e-5, gradient_checkpointing=checkpointing,
                      skip_max_kl=1e9, skip_max_grad_norm=1e9)
    learner = Learner(model, cfg, 1.0, tok.eos_token_id, max_completion_length=192)
    learner.step(trajs)  # warm-up
    sync()
    times, peaks, ratios = [], [], []
    for _ in range(steps):
        m = learner.step(trajs).metrics()
        sync()
        times.append(m["time/update_s"])
        peaks.append(m.get("memory/peak_cuda_bytes", m.get("memory/peak_rss_bytes")))
        ratios.append(m.get("ratio_mean", float("nan")))
    out = {"model": MODEL_NAME, "dtype": str(dtype).replace("torch.", ""),
           "gradient_checkpointing": checkpointing, "sequences": len(trajs), "tokens_per_sequence": 256,
           "update_s_median": statistics.median(times), "peak_gib": max(peaks) / 2**30,
           "ratio_mean_first_step": ratios[0], "skipped": m["skipped"]}
    del learner, model
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return out


def bench_generate(tok, dtype, rows=32, new=128):
    from selfrl.engines.reference import Engine

    model = with_lora(qwen05(tok, dtype)).to(DEVICE)
    engine = Engine(model, tok)
    prompts = [tok.encode("You are a careful assistant. What is 17+25?")] * rows
    engine.generate(prompts[:2], 4)
    sync()
    t = time.perf_counter()
    gens = engine.generate(prompts, new, temperature=1.0)
    sync()
    secs = time.perf_counter() - t
    n = sum(len(g.token_ids) for g in gens)
    del engine, model
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return {"dtype": str(dtype).replace("torch.", ""), "rows": rows, "tokens": n, "seconds": secs, "tokens_per_s": n / secs}


def even_share(traj, ctx):
    """Share of even token ids in the completion (varies between samples of a random model)."""
    ids = [t for t, m in zip(traj.token_ids, traj.completion_mask) if m]
    return sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1)


def cli_run(model_dir: Path, run_dir: Path, extra: list[str], max_new_tokens: int) -> dict:
    from selfrl.cli import main

    cfg = run_dir.parent / f"{run_dir.name}.toml"
    cfg.write_text(f"""iterations = 2
num_prompts = 4
num_generations = 4
reward_weights = {{ even = 1.0 }}
[lora]
r = 8
[task]
num_train = 40
[rollout]
max_new_tokens = {max_new_tokens}
max_turns = 1
temperature = 1.0
[gate]
val_size = 8
eval_every = 1
[collapse]
enabled = false
""")
    t = time.perf_counter()
    code = main(["run", "--config", str(cfg), "--model", str(model_dir), "--run-dir", str(run_dir), *extra])
    wall = time.perf_counter() - t
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()] if code == 0 else []
    keys = ("time/update_s", "memory/peak_cuda_bytes", "memory/peak_rss_bytes", "time/rollout_s", "skipped", "kl",
            "ratio_mean", "reward/mean")
    per_step = [{k: r.get(k) for k in keys if k in r} for r in rows if "time/rollout_s" in r]
    return {"exit_code": code, "wall_s": wall, "args": extra, "iterations": per_step}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="one timed step")
    ap.add_argument("--cpu-smoke", action="store_true", help="a small model on the CPU: checks this script only")
    args = ap.parse_args()
    global DEVICE, SHAPE, MODEL_NAME
    if args.cpu_smoke:
        DEVICE, SHAPE, MODEL_NAME = "cpu", SMALL, "small qwen2 (random, CPU smoke test)"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from conftest import build_tiny_tokenizer, save_tiny_phi

    from selfrl.envs.rewards import REWARD_FUNCS

    REWARD_FUNCS["even"] = even_share
    tok = build_tiny_tokenizer()
    res: dict = {"gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "none (CPU smoke test)",
                 "torch": torch.__version__}
    print(json.dumps(res), flush=True)

    def record(key, value):
        res.setdefault(key, []).append(value)
        print(key, json.dumps(value), flush=True)
        (out / "bench.json").write_text(json.dumps(res, indent=1))

    steps = 1 if args.quick else 3
    for dtype, ckpt in [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True), (torch.float32, True)]:
        try:
            record("learner", bench_learner(tok, dtype, ckpt, steps))
        except Exception as e:  # recorded, and the other measurements still run
            record("learner", {"dtype": str(dtype), "gradient_checkpointing": ckpt, "error": repr(e)})
    for dtype in (torch.float32, torch.bfloat16):
        try:
            record("generate", bench_generate(tok, dtype))
        except Exception as e:
            record("generate", {"dtype": str(dtype), "error": repr(e)})
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="selfrl-gpu-"))
    tiny = save_tiny_phi(work / "tiny-phi", tok)
    big = work / "qwen05-random"
    qwen05(tok).save_pretrained(big)
    tok.save_pretrained(big)
    gc = ["--device", DEVICE, "--dtype", "bfloat16", "--gradient-checkpointing"]
    record("run", {"model": "tiny-phi", **cli_run(tiny, work / "run-tiny", gc, 12)})
    record("run", {"model": "qwen2.5-0.5b-shape", **cli_run(big, work / "run-qwen", gc, 32)})
    record("run", {"model": "qwen2.5-0.5b-shape", **cli_run(big, work / "run-qwen-fp32", ["--device", DEVICE,
                                                                                          "--dtype", "float32"], 32)})
    return 0


if __name__ == "__main__":
    sys.exit(main())

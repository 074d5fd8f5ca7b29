"""Frozen fp32 products through oneDNN (``model.cpu_matmul = "auto"``, ``selfrl.model.matmul``) against
torch's BLAS (``"torch"``, MKL in the CPU wheels), side by side in one process.

- **ceiling**: one 4096 x 4096 fp32 product per library, FLOP/s (the bound the other benchmarks
  take is the faster one).
- **products**: every matrix product of one forward pass of the model (its layers' shapes, each
  layer once per decoder layer, the output layer once) at 1, 16, 64 and 2,048 rows, seconds per
  library. Each shape is timed on its own, so its weight may sit in the cache: a real pass, which
  reads every weight once, is slower at few rows (the rollouts below are the real measure).
- **rollouts**: one ``selfrl run`` iteration of ``configs/demo.toml`` (8 tasks x 8, multi-turn with
  the calculator) on two slot engines, one over a policy per setting (the same seed, so the same
  LoRA), alternating repeat by repeat; useful tokens/s and their share of both ceilings' bounds.
- **update**: one ``Learner.step`` of the demo's settings on that batch (advantages +1 / -1 in
  turn), per policy, alternating, from the same weights and optimizer state; seconds and losses.

    python benchmarks/bench_matmul.py --repeats 3
    python benchmarks/bench_matmul.py --repeats 3 --adapter runs/demo/adapters/v000002   # a trained policy
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ceiling import CONFIG, matmul_flops_by_library, matmul_params  # noqa: E402
from bench_engines import alternating_rollouts, policy_with_adapter  # noqa: E402
from common import Stats, base_parser, bench_config, command_line, envelope, finish, print_table, timed  # noqa: E402

SETTINGS = ("torch", "auto")  # model.cpu_matmul of the two policies


def pass_products(model, rows: int, repeats: int) -> dict[str, float]:
    """Seconds of one forward pass's matrix products at ``rows`` rows, per library: each distinct
    (out, in) weight shape of ``model``'s frozen linear layers timed alone (median of ``repeats``),
    times how many layers have it."""
    import torch
    import torch.nn.functional as F

    from selfrl.model.matmul import available, linear

    shapes: dict[tuple[int, int], int] = {}
    for m in model.modules():
        if type(m) is torch.nn.Linear and not m.weight.requires_grad:
            shapes[tuple(m.weight.shape)] = shapes.get(tuple(m.weight.shape), 0) + 1
    out = {"torch": 0.0, **({"onednn": 0.0} if available() else {})}
    for (o, i), count in shapes.items():
        w, x = torch.randn(o, i), torch.randn(rows, i)
        for name in out:
            fn = (lambda: F.linear(x, w)) if name == "torch" else (lambda: linear(x, w))
            out[name] += timed(fn, max(3, repeats), warmup=1)[0].median * count
    return out


def main(argv: list[str] | None = None) -> dict:
    p = base_parser(__doc__)
    p.add_argument("--rows", default="1,16,64,2048", help="rows of the products table, comma-separated")
    p.add_argument("--adapter", type=Path, default=None,
                   help="a saved adapter version (a run's adapters/vNNNNNN) for both policies: a trained policy")
    args = p.parse_args(argv)
    from peft import set_peft_model_state_dict

    from selfrl.record.adapters import lora_state
    from selfrl.engines.slots import SlotEngine
    from selfrl.rl.learner import Learner, kl_reference
    from selfrl.model.matmul import is_routed

    from bench_update import sampled_batch

    result = envelope(args, command_line("bench_matmul.py", argv))
    cfg = bench_config(args, CONFIG, "bench-matmul-")
    n = 256 if args.tiny else 4096
    ceiling = matmul_flops_by_library(n, max(1, args.repeats))
    policies = {}
    for setting in SETTINGS:
        c = copy.deepcopy(cfg)
        c.model.cpu_matmul = setting
        policies[setting] = policy_with_adapter(c, args.adapter, result)
    model, tok = policies["auto"]
    P = matmul_params(model)
    bounds = {lib: s.median / (2 * P) for lib, s in ceiling.items()}
    result.update({"model": cfg.model.name, "matmul_n": n, "matmul_flops_per_s": ceiling, "matmul_params": P,
                   "generation_bound_tokens_per_s": bounds,
                   "routed_layers": {s: sum(is_routed(m) for m in policies[s][0].modules()) for s in SETTINGS}})
    print_table(f"{n} x {n} fp32 product, FLOP/s, median [min, max] of {max(1, args.repeats)}",
                ["library", "GFLOP/s", "bound of a 2P token (tokens/s)"],
                [[lib, s.fmt(".0f", 1e-9), f"{bounds[lib]:.0f}"] for lib, s in ceiling.items()])

    base = model.get_base_model()
    products, rows_out = {}, []
    for rows in [int(r) for r in args.rows.split(",")]:
        secs = pass_products(base, rows, args.repeats)
        products[rows] = secs
        ratio = secs["torch"] / secs["onednn"] if "onednn" in secs else float("nan")
        rows_out.append([rows, f"{secs['torch'] * 1e3:.1f}", f"{secs.get('onednn', float('nan')) * 1e3:.1f}",
                         f"{ratio:.2f}x"])
    result["pass_products_s"] = products
    print_table("the matrix products of one forward pass (each shape timed alone), ms",
                ["rows", "torch (MKL)", "oneDNN", "speed-up"], rows_out)

    engines = {s: SlotEngine(m, t, driver="caller") for s, (m, t) in policies.items()}
    best = max(bounds.values())
    roll, rows_out, times, toks = alternating_rollouts(engines, cfg, args.repeats, best)
    for row, s in zip(rows_out, SETTINGS):
        tps = roll[s]["tokens_per_s"].median
        row.append(f"{tps / bounds['torch']:.1%}")
        roll[s]["fraction_of_torch_bound"] = tps / bounds["torch"]
    result["rollouts"] = roll
    print_table(f"one iteration's rollouts, median [min, max] of {args.repeats}; bounds {best:.0f} tokens/s "
                f"(the faster library) and {bounds['torch']:.0f} (torch's BLAS)",
                ["cpu_matmul", "seconds", "useful tokens", "tokens/s", "of the bound", "of torch's bound"], rows_out)
    for e in engines.values():
        e.close()

    trajs = sampled_batch(cfg, model, tok)
    learners = {s: Learner(m, cfg.train, cfg.rollout.temperature, t.pad_token_id, cfg.max_completion_length,
                           ref_state=kl_reference(m, cfg.lora.init_adapter), tokenizer=t)
                for s, (m, t) in policies.items()}
    start = {s: {k: v.clone() for k, v in lora_state(m).items()} for s, (m, _) in policies.items()}
    secs, losses = {s: [] for s in SETTINGS}, {s: [] for s in SETTINGS}
    for _ in range(args.repeats):
        for s in SETTINGS:
            set_peft_model_state_dict(policies[s][0], start[s])
            learners[s].reset_optimizer()
            t = time.perf_counter()
            res = learners[s].step(trajs)
            secs[s].append(time.perf_counter() - t)
            losses[s].append(res.stats["loss"])
    for s in SETTINGS:
        set_peft_model_state_dict(policies[s][0], start[s])
    update = {s: {"seconds": Stats.of(secs[s]), "loss": losses[s][0]} for s in SETTINGS}
    update["speed_up"] = update["torch"]["seconds"].median / update["auto"]["seconds"].median
    update["loss_gap"] = abs(losses["torch"][0] - losses["auto"][0])
    result["update"] = update
    result["update_sequences"] = len(trajs)
    print_table(f"one update of {len(trajs)} sequences, seconds, median [min, max] of {args.repeats}, alternating",
                ["cpu_matmul", "seconds", "loss"],
                [[s, update[s]["seconds"].fmt(".1f"), f"{update[s]['loss']:.8f}"] for s in SETTINGS])
    print(f"update speed-up {update['speed_up']:.2f}x, |loss gap| {update['loss_gap']:.1e}")
    print(f"wrote {finish(result, 'matmul' if args.adapter is None else 'matmul_trained', args.out)}")
    return result


if __name__ == "__main__":
    main()

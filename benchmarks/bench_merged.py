"""The slot engine with its LoRA merged (and the small-batch product) against the peft model's own
forward pass, side by side in one process: decoding steps by active rows, the demo's first rollout
batch, and how far the sampled logprobs are from the learner's recomputation.

- **products**: every linear weight of the model (the output layer too) applied to ``rows`` input
  rows, ``F.linear`` against :func:`selfrl.engines.mergedpolicy.small_batch_linear`, as the
  weights' bytes streamed per second (the pair alternating, best of the repeats).
- **steps**: greedy decoding of ``rows`` copies of one prompt (the rows never finish before the
  token limit), milliseconds per decoding step; the two engines alternate repeat by repeat.
- **rollouts**: one ``selfrl run`` iteration of ``configs/demo.toml`` (8 tasks x 8, multi-turn
  with the calculator), useful tokens/s and the share of the 2P bound (the matmul FLOP/s measured
  at the start of the run over 2P).
- **exactness**: after a random perturbation of the LoRA (a trained adapter), the largest
  ``|sampled - recomputed|`` logprob over sampled rows of each engine, the recomputation being a
  full forward pass of the peft model on one unpadded row (what the learner computes).

    python benchmarks/bench_merged.py --repeats 3
    python benchmarks/bench_merged.py --repeats 3 --adapter runs/demo/adapters/v000002   # a trained policy
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ceiling import CONFIG, matmul_flops, matmul_params  # noqa: E402
from bench_engines import alternating_rollouts, policy_with_adapter  # noqa: E402
from common import (  # noqa: E402
    Stats,
    base_parser,
    bench_config,
    command_line,
    envelope,
    finish,
    first_batch,
    print_table,
)

VARIANTS = {"unmerged": False, "merged": True}  # name -> SlotEngine(merge_lora=...)


def products_gb_s(weights: list, rows: int, fn, repeats: int) -> float:
    """GB/s of weight bytes streamed by ``fn(x, w)`` over ``weights``, ``rows`` inputs each (best of ``repeats``)."""
    import torch

    xs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for w in weights:
            fn(xs[w.shape[1]], w)
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def step_ms(engine, prompt: list[int], rows: int, max_new_tokens: int) -> float:
    """Milliseconds per decoding step of ``rows`` greedy copies of ``prompt`` (prefill excluded)."""
    engine.generate([prompt], 1, greedy=True)  # the prompt's prefix is stored: the timed prefill is one token
    s0, t = engine.steps, time.perf_counter()
    engine.generate([prompt] * rows, max_new_tokens, greedy=True)
    return (time.perf_counter() - t) / max(1, engine.steps - s0) * 1000


def worst_logprob_gap(engine, model, prompt: list[int], rows: int, max_new_tokens: int) -> float:
    """Largest |sampled - recomputed| logprob over ``rows`` sampled rows at temperature 1."""
    import torch

    worst = 0.0
    for g in engine.generate([prompt] * rows, max_new_tokens, temperature=1.0):
        ids = torch.tensor([prompt + list(g.token_ids)])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()  # (n, V)
        lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(g.token_ids)[:, None])[:, 0]
        worst = max(worst, (lp - torch.tensor(g.logprobs)).abs().max().item())
    return worst


def main(argv: list[str] | None = None) -> dict:
    p = base_parser(__doc__)
    p.add_argument("--rows", default="1,2,4,8,16,32,64", help="active rows of the step table, comma-separated")
    p.add_argument("--skip-rollouts", action="store_true", help="the step table and exactness only")
    p.add_argument("--adapter", type=Path, default=None,
                   help="a saved adapter version (a run's adapters/vNNNNNN) to sample with instead of the starting "
                        "LoRA: a trained policy's rollouts (more tool calls, longer turns); writes merged_trained.json")
    args = p.parse_args(argv)
    import torch

    from selfrl.chat.template import prompt_ids
    from selfrl.engines.slots import SlotEngine

    result = envelope(args, command_line("bench_merged.py", argv))
    cfg = bench_config(args, CONFIG, "bench-merged-")
    flops = matmul_flops(256 if args.tiny else 4096, max(1, args.repeats))
    model, tok = policy_with_adapter(cfg, args.adapter, result)
    engines = {n: SlotEngine(model, tok, driver="caller", merge_lora=m) for n, m in VARIANTS.items()}
    merged = engines["merged"].merged
    P = matmul_params(model)
    bound = flops.median / (2 * P)
    result.update({"model": cfg.model.name, "matmul_flops_per_s": flops, "matmul_params": P,
                   "generation_bound_tokens_per_s": bound, "torch_threads": torch.get_num_threads(),
                   "merged_layers": merged.merged_layers, "merged_extra_bytes": merged.extra_bytes})
    prompt = prompt_ids(tok, [{"role": "user", "content": "Write a long story about a cat who learns to count."}])
    new_tokens = 6 if args.tiny else 24

    import torch.nn.functional as F

    from selfrl.engines.mergedpolicy import small_batch_linear

    weights = [m.weight for m in merged.view.modules() if hasattr(m, "weight") and m.weight.dim() == 2
               and m is not merged.view.get_input_embeddings()]
    products, rows_out = {}, []
    with torch.no_grad():
        for r in range(1, 5 if args.tiny else 17):
            lin = products_gb_s(weights, r, F.linear, max(3, args.repeats))
            small = products_gb_s(weights, r, small_batch_linear, max(3, args.repeats))
            products[r] = {"linear_gb_s": lin, "small_batch_gb_s": small}
            rows_out.append([r, f"{lin:.1f}", f"{small:.1f}", f"{small / lin:.2f}x"])
    result["products"] = products
    print_table(f"every linear weight ({sum(w.numel() for w in weights) * 4 / 1e6:.0f} MB) times `rows` inputs, "
                "GB/s of weights, best of the repeats", ["rows", "F.linear", "small_batch_linear", "ratio"], rows_out)

    levels = [int(r) for r in args.rows.split(",")]
    steps, rows_out = {}, []
    with torch.no_grad():
        for r in levels:
            ms = {n: [] for n in engines}
            for _ in range(args.repeats):
                for n, e in engines.items():
                    ms[n].append(step_ms(e, prompt, r, new_tokens))
            steps[r] = {n: Stats.of(v) for n, v in ms.items()}
            ratio = statistics.median(ms["unmerged"]) / statistics.median(ms["merged"])
            steps[r]["unmerged_over_merged"] = ratio
            best = steps[r]["merged"].median / 1000
            rows_out.append([r, steps[r]["unmerged"].fmt(".0f"), steps[r]["merged"].fmt(".0f"), f"{ratio:.2f}x",
                             f"{r / best:.0f}", f"{r / best / bound:.1%}"])
            print(f"{r} rows: unmerged {steps[r]['unmerged'].median:.0f} ms, merged {steps[r]['merged'].median:.0f} ms",
                  flush=True)
    result["steps_ms"] = steps
    print_table(f"one decoding step (ms), median [min, max] of {args.repeats}, engines alternating",
                ["rows", "unmerged", "merged", "unmerged / merged", "merged tokens/s", "of the 2P bound"], rows_out)

    if not args.skip_rollouts:
        tasks, _ = first_batch(cfg)
        roll, rows_out, times, _ = alternating_rollouts(engines, cfg, args.repeats, bound)
        roll["unmerged_over_merged_seconds"] = [u / m for u, m in zip(times["unmerged"], times["merged"])]
        result["rollouts"] = roll
        print_table(f"one iteration's rollouts ({len(tasks)}), median [min, max] of {args.repeats}, bound "
                    f"{bound:.0f} tokens/s", ["engine", "seconds", "useful tokens", "tokens/s", "of the 2P bound"],
                    rows_out)

    torch.manual_seed(0)
    with torch.no_grad():  # a trained adapter: every LoRA matrix moved
        for n, t in model.named_parameters():
            if "lora_" in n:
                t.add_(0.02 * torch.randn_like(t))
    gaps = {n: worst_logprob_gap(e, model, prompt, 2 if args.tiny else 4, new_tokens) for n, e in engines.items()}
    result["max_abs_logprob_gap"] = gaps
    print("largest |sampled - recomputed| logprob: " + ", ".join(f"{n} {g:.2e}" for n, g in gaps.items()))
    for e in engines.values():
        e.close()
    print(f"wrote {finish(result, 'merged' if args.adapter is None else 'merged_trained', args.out)}")
    return result


if __name__ == "__main__":
    main()

"""The slot engine with a shared prefix attended once for all rows against every row attending to its
own copy, side by side in one process (two engines on one model, alternating repeat by repeat).

- **rollouts**: one ``selfrl run`` iteration of ``configs/demo.toml`` (8 tasks x 8, multi-turn with
  the calculator; a 211-token system prompt), seconds and useful tokens/s, and the share of the 2P
  bound (the matmul FLOP/s measured at the start over 2P; see ``bench_ceiling.py``).
- **long system prompt**: ``rows`` greedy rows of 24 new tokens after a system prompt of about
  ``--system-tokens`` tokens (an agent with many tool descriptions) and a short question each.
- **same ids**: whether both engines sampled the same ids (they should, rounding aside).
- **kernel**: the shared-prefix attention of one layer alone at the shapes the demo's passes have
  (rows x queries a row, prefix and own columns; the embedded model's 9 query heads over 3 key/value
  heads of 64), by batched products and one softmax (``attend_by_products``) against torch's fused
  CPU kernel merged by log-sum-exp (what ``attend_with_shared_prefix`` runs on the CPU), microseconds.

    python benchmarks/bench_shared_attention.py --repeats 3
    python benchmarks/bench_shared_attention.py --repeats 3 --adapter runs/demo/adapters/v000002
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ceiling import CONFIG, matmul_flops, matmul_params  # noqa: E402
from bench_engines import alternating_rollouts, policy_with_adapter  # noqa: E402
from common import (  # noqa: E402
    Stats, base_parser, bench_config, command_line, envelope, finish, first_batch, print_table,
)

VARIANTS = {"own copies": False, "shared prefix once": True}  # name -> SlotEngine(shared_prefix_attention=...)
# (rows, queries a row, prefix columns, own columns) of the demo's passes (a trained policy's batch): decoding
# at 64 rows early and 55 later, the tail, the first turn's prefill, a tool reply's prefill, a drafted pass
KERNEL_SHAPES = [(64, 1, 211, 20), (55, 1, 211, 80), (24, 1, 211, 100), (4, 1, 211, 116), (2, 1, 211, 160),
                 (8, 17, 211, 17), (5, 37, 211, 81), (9, 3, 211, 110)]


def kernel_table(repeats: int, tiny: bool) -> list[dict]:
    """The attention of one layer alone at ``KERNEL_SHAPES`` (halved for ``tiny``): products against
    the fused kernel, the median of ``max(repeats, 5) x 10`` calls each, microseconds, and the largest
    difference between the two."""
    import torch

    from selfrl.engines.sharedattention import _attend_fused, attend_by_products, fused_kernel_available, fused_masks

    def fused(q, pk, pv, k, v, mask, scaling):  # the kernel's masks built at each call, as a pass's first layer does
        return _attend_fused(q, pk, pv, k, v, fused_masks(mask, q.shape[1] // pk.shape[0], q.dtype), scaling)

    if not fused_kernel_available():
        return []
    out = []
    for B, T, P, S in KERNEL_SHAPES[:2] if tiny else KERNEL_SHAPES:
        g = torch.Generator().manual_seed(B * 1000 + T)
        q = torch.randn(B, 9, T, 64, generator=g)
        pk, pv = torch.randn(3, P, 64, generator=g), torch.randn(3, P, 64, generator=g)
        k, v = torch.randn(B, 3, S, 64, generator=g), torch.randn(B, 3, S, 64, generator=g)
        pos = S - T + torch.arange(T)  # the last T own columns are the pass's queries
        mask = (torch.arange(S)[None, None, None, :] <= pos[None, None, :, None]).expand(B, 1, T, S)
        row = {"rows": B, "queries": T, "prefix": P, "own": S}
        for name, fn in (("products", attend_by_products), ("fused", fused)):
            fn(q, pk, pv, k, v, mask, 0.125)
            times = []
            for _ in range(max(repeats, 5) * 10):
                t = time.perf_counter()
                fn(q, pk, pv, k, v, mask, 0.125)
                times.append(time.perf_counter() - t)
            row[name + "_us"] = Stats.of(times).median * 1e6
        diff = attend_by_products(q, pk, pv, k, v, mask, 0.125) - fused(q, pk, pv, k, v, mask, 0.125)
        row["max_abs_diff"] = float(diff.abs().max())
        out.append(row)
    return out


def long_prompts(tok, rows: int, system_tokens: int) -> list[list[int]]:
    """``rows`` chat prompts: one system prompt of about ``system_tokens`` tokens (tool descriptions),
    a different question each."""
    from selfrl.chat.template import prompt_ids

    tools, i = "You are an agent with tools.", 0
    while len(tok(tools)["input_ids"]) < system_tokens:
        tools += f" Tool {i}: lookup_{i}(query: string) returns record {i} of the catalogue."
        i += 1
    return [prompt_ids(tok, [{"role": "system", "content": tools},
                             {"role": "user", "content": f"Question {r}: tell me a story about the number {r}."}])
            for r in range(rows)]


def main(argv: list[str] | None = None) -> dict:
    p = base_parser(__doc__)
    p.add_argument("--rows", default="64,16", help="rows of the long-system-prompt table, comma-separated")
    p.add_argument("--system-tokens", type=int, default=1000, help="tokens of the long system prompt")
    p.add_argument("--adapter", type=Path, default=None,
                   help="a saved adapter version (a run's adapters/vNNNNNN) to sample with: a trained policy")
    args = p.parse_args(argv)
    from selfrl.engines.slots import SlotEngine

    result = envelope(args, command_line("bench_shared_attention.py", argv))
    cfg = bench_config(args, CONFIG, "bench-shared-")
    flops = matmul_flops(256 if args.tiny else 4096, max(1, args.repeats))
    model, tok = policy_with_adapter(cfg, args.adapter, result)
    engines = {n: SlotEngine(model, tok, driver="caller", shared_prefix_attention=v) for n, v in VARIANTS.items()}
    bound = flops.median / (2 * matmul_params(model))
    result.update({"model": cfg.model.name, "matmul_flops_per_s": flops, "generation_bound_tokens_per_s": bound,
                   "shared_prefix_layers": engines["shared prefix once"].merged.shared_prefix_layers})

    batch = len(first_batch(cfg)[0])
    roll, rows_out, times, toks = alternating_rollouts(engines, cfg, args.repeats, bound)
    base = Stats.of(times["own copies"]).median
    for row, n in zip(rows_out, engines):
        row.append(f"{base / Stats.of(times[n]).median:.2f}x")
    result["rollouts"] = roll
    result["same_rollout_tokens"] = toks["own copies"] == toks["shared prefix once"]
    print_table(f"one iteration's rollouts ({batch}), median [min, max] of {args.repeats}, bound {bound:.0f} "
                "tokens/s", ["attention", "seconds", "useful tokens", "tokens/s", "of the 2P bound", "speed-up"],
                rows_out)

    long, rows_out = {}, []
    for rows in [int(r) for r in args.rows.split(",")]:
        prompts = long_prompts(tok, rows, 64 if args.tiny else args.system_tokens)
        secs, ids = {n: [] for n in engines}, {}
        for e in engines.values():
            e.generate(prompts[:2], 2, greedy=True)  # the system prompt encoded and stored
        for _ in range(args.repeats):
            for n, e in engines.items():
                t = time.perf_counter()
                gens = e.generate(prompts, 24, greedy=True)
                secs[n].append(time.perf_counter() - t)
                ids[n] = [g.token_ids for g in gens]
        tokens = sum(len(g) for g in ids["own copies"])
        ratio = Stats.of(secs["own copies"]).median / Stats.of(secs["shared prefix once"]).median
        long[rows] = {"prompt_tokens": len(prompts[0]), "tokens": tokens, "same_ids": ids["own copies"] ==
                      ids["shared prefix once"], **{n: Stats.of(v) for n, v in secs.items()}, "speed_up": ratio}
        rows_out.append([rows, len(prompts[0]), Stats.of(secs["own copies"]).fmt(".2f"),
                         Stats.of(secs["shared prefix once"]).fmt(".2f"), f"{ratio:.2f}x", long[rows]["same_ids"]])
    result["long_system_prompt"] = long
    kernel = kernel_table(args.repeats, args.tiny)
    result["kernel"] = kernel
    print_table("one layer's attention alone, microseconds (median)", ["rows x queries", "prefix + own columns",
                "products", "fused kernel", "speed-up", "largest difference"],
                [[f"{r['rows']} x {r['queries']}", f"{r['prefix']} + {r['own']}", f"{r['products_us']:.0f}",
                  f"{r['fused_us']:.0f}", f"{r['products_us'] / r['fused_us']:.2f}x", f"{r['max_abs_diff']:.1e}"]
                 for r in kernel])
    print_table(f"greedy rows after a long system prompt, 24 new tokens, seconds, median [min, max] of {args.repeats}",
                ["rows", "prompt tokens", "own copies", "shared prefix once", "speed-up", "same ids"], rows_out)
    for e in engines.values():
        e.close()
    print(f"wrote {finish(result, 'shared_attention' if args.adapter is None else 'shared_attention_trained', args.out)}")
    return result


if __name__ == "__main__":
    main()

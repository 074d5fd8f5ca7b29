"""Choosing a sampled id: one cumulative sum over the vocabulary (``inverse_cdf_flat``) against the
two-level search over blocks (``inverse_cdf``), side by side in one process, calls alternating.

- **time**: microseconds a call for ``rows`` rows of the embedded model's 49,152 ids (the median of
  ``max(repeats, 5) x 20`` calls each), and the ratio.
- **rounding**: of ``draws`` random points on random distributions (the demo's temperature 0.7 over
  random logits of several scales, some with a run of zero-mass ids), how many ids each method
  chooses otherwise than the same search in float64. Both sum in fp32 in different orders, so each
  misses a few points within rounding of a boundary between two ids.

    python benchmarks/bench_choice.py --repeats 5
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import base_parser, command_line, envelope, finish, print_table  # noqa: E402

VOCAB = 49_152  # SmolLM2's


def main(argv: list[str] | None = None) -> dict:
    p = base_parser(__doc__)
    p.add_argument("--rows", default="4,16,64", help="rows a call, comma-separated")
    p.add_argument("--draws", type=int, default=64 * 200, help="random points for the rounding count")
    args = p.parse_args(argv)
    import torch

    from selfrl.engines.sampling import inverse_cdf, inverse_cdf_flat

    result = envelope(args, command_line("bench_choice.py", argv))
    vocab = 4096 if args.tiny else VOCAB
    methods = {"one cumulative sum": inverse_cdf_flat, "two levels": inverse_cdf}
    g = torch.Generator().manual_seed(0)
    timing, rows_out = {}, []
    for rows in (int(r) for r in args.rows.split(",")):
        probs = torch.softmax(torch.randn(rows, vocab, generator=g) / 0.7, dim=-1)  # (rows, V)
        u = torch.rand(rows, generator=g)  # (rows,)
        times: dict[str, list[float]] = {name: [] for name in methods}
        for _ in range(max(args.repeats, 5)):
            for name, fn in methods.items():
                fn(probs, u)
                t = time.perf_counter()
                for _ in range(20):
                    fn(probs, u)
                times[name].append((time.perf_counter() - t) / 20 * 1e6)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        ratio = med["one cumulative sum"] / med["two levels"]
        timing[rows] = {**med, "speed_up": ratio}
        rows_out.append([rows, f"{med['one cumulative sum']:.0f}", f"{med['two levels']:.0f}", f"{ratio:.2f}x"])
    print_table(f"microseconds a call, {vocab} ids", ["rows", "one cumulative sum", "two levels", "speed-up"], rows_out)
    wrong = {name: 0 for name in methods}
    done = 0
    trial = 0
    while done < args.draws:
        b = min(64, args.draws - done)
        probs = torch.softmax(torch.randn(b, vocab, generator=g) * (trial % 7 + 1) / 0.7, dim=-1)
        if trial % 5 == 0:
            probs[:, vocab // 50:vocab // 2] = 0  # a run of zero-mass ids (a nucleus, a grammar's mask)
        u = torch.rand(b, generator=g)
        exact = inverse_cdf_flat(probs.double(), u.double())
        for name, fn in methods.items():
            wrong[name] += int((fn(probs, u) != exact).sum())
        done += b
        trial += 1
    print_table(f"ids chosen otherwise than in float64, of {done} points", list(methods), [list(wrong.values())])
    result.update({"vocab": vocab, "microseconds": timing, "draws": done, "differ_from_float64": wrong})
    print(f"wrote {finish(result, 'choice', args.out)}")
    return result


if __name__ == "__main__":
    main()

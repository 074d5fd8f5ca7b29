"""One forward pass a step (``SlotEngine(pack_passes=True)``, ``selfrl.engines.packedattention``) against a
prefill pass and a decoding pass one by one, side by side in one process over one engine.

- **rollouts**: one ``selfrl run`` iteration of ``configs/demo.toml`` (8 tasks x 8, multi-turn with the
  calculator), the two settings alternating repeat by repeat (the order flips each repeat): seconds,
  useful tokens/s and their share of the machine's bound (``bench_ceiling.matmul_flops`` over 2P,
  measured before and after, averaged), and the **admitting steps**: the steps that admit rows while
  others decode (the only ones packing changes), their count and seconds, timed around each step.
- **same ids**: whether both settings sampled the same ids (rounding can flip a draw in fp32).

    python benchmarks/bench_packed.py --repeats 4
    python benchmarks/bench_packed.py --repeats 4 --adapter runs/demo/adapters/v000002   # a trained policy
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ceiling import CONFIG, matmul_flops, matmul_params  # noqa: E402
from bench_drafts import timed_rollouts  # noqa: E402
from bench_engines import policy_with_adapter  # noqa: E402
from common import Stats, base_parser, bench_config, command_line, envelope, finish, first_batch, print_table  # noqa: E402

SETTINGS = {"two passes": False, "one packed pass": True}  # name -> SlotEngine.pack_passes


def main(argv: list[str] | None = None) -> dict:
    p = base_parser(__doc__)
    p.add_argument("--adapter", type=Path, default=None,
                   help="a saved adapter version (a run's adapters/vNNNNNN): a trained policy")
    args = p.parse_args(argv)
    from selfrl.engines.slots import SlotEngine

    result = envelope(args, command_line("bench_packed.py", argv))
    cfg = bench_config(args, CONFIG, "bench-packed-")
    n = 256 if args.tiny else 4096
    before = matmul_flops(n, max(1, args.repeats))
    model, tok = policy_with_adapter(cfg, args.adapter, result)
    engine = SlotEngine(model, tok, driver="caller")
    step = engine._step
    admitting: list[float] = []  # seconds of each step that admitted rows while others decoded

    def timed_step() -> None:
        joins = bool(engine._queue) and bool(engine._rows)
        t = time.perf_counter()
        step()
        if joins:
            admitting.append(time.perf_counter() - t)

    engine._step = timed_step
    tasks, tools = first_batch(cfg)
    timed_rollouts(engine, tasks[:max(2, len(tasks) // 8)], tools, cfg.rollout, 99)  # warm-up
    runs: dict[str, list] = {name: [] for name in SETTINGS}
    for rep in range(max(1, args.repeats)):
        for name in (list(SETTINGS) if rep % 2 == 0 else list(SETTINGS)[::-1]):
            engine.pack_passes = SETTINGS[name]
            admitting.clear()
            packed = engine.packed_passes
            seconds, tokens, ids, _ = timed_rollouts(engine, tasks, tools, cfg.rollout, rep)
            runs[name].append((seconds, tokens, ids, list(admitting), engine.packed_passes - packed))
            print(f"{name} repeat {rep}: {tokens} tokens in {seconds:.2f} s, {len(admitting)} admitting steps "
                  f"{sum(admitting):.2f} s", flush=True)
    after = matmul_flops(n, max(1, args.repeats))
    bound = (before.median + after.median) / 2 / (2 * matmul_params(model))
    result.update({"model": cfg.model.name, "matmul_flops_per_s_before": before, "matmul_flops_per_s_after": after,
                   "bound_tokens_per_s": bound})
    out, rows = {}, []
    base = Stats.of([r[0] for r in runs["two passes"]]).median
    for name, rs in runs.items():
        secs, tps = Stats.of([r[0] for r in rs]), Stats.of([r[1] / r[0] for r in rs])
        steps = [s for r in rs for s in r[3]]
        per_step = sum(steps) / max(len(steps), 1)
        same = all(r[2] == r0[2] for r, r0 in zip(rs, runs["two passes"]))
        out[name] = {"seconds": secs, "tokens": [r[1] for r in rs], "tokens_per_s": tps,
                     "fraction_of_bound": tps.median / bound, "admitting_steps": len(steps) / len(rs),
                     "admitting_seconds": Stats.of([sum(r[3]) for r in rs]), "seconds_per_admitting_step": per_step,
                     "packed_passes": sum(r[4] for r in rs), "same_ids_as_first": same, "speed_up": base / secs.median}
        rows.append([name, secs.fmt(".2f"), tps.fmt(".0f"), f"{tps.median / bound:.1%}",
                     f"{len(steps) / len(rs):.0f}", f"{per_step * 1e3:.0f}", f"{base / secs.median:.2f}x",
                     "yes" if same else "no"])
    result["rollouts"] = out
    print_table(f"rollouts: {len(tasks)} trajectories, median [min, max] of {max(1, args.repeats)}, alternating; "
                f"bound {bound:.0f} tokens/s", ["steps", "seconds", "tokens/s", "of the bound", "admitting steps",
                                                "ms an admitting step", "speed-up", "same ids"], rows)
    engine.close()
    print(f"wrote {finish(result, 'packed' if args.adapter is None else 'packed_trained', args.out)}")
    return result


if __name__ == "__main__":
    main()

"""Speculative decoding from each row's own context (``SlotEngine(draft_ids=..., draft_budget=...)``,
``selfrl.engines.drafts``) against none, side by side in one process over one policy.

- **rollouts**: one ``selfrl run`` iteration of ``configs/demo.toml`` (8 tasks x 8, multi-turn with
  the calculator, temperature 0.7), each engine in turn repeat by repeat: seconds, useful tokens/s,
  their share of the machine's bound (``bench_ceiling.matmul_flops``: the faster matrix library),
  decoding passes, and the drafted ids kept.
- **passes**: what a forward pass of the sampling view costs at ``rows`` rows x ``ids`` ids a row (no
  cache: the linear layers and the output layer, which dominate), the fastest of ``--repeats``: where
  feeding more ids a pass stays nearly free (bound by reading the weights) and where it does not.
- **validation**: the gate's greedy pass over the first 64 held-out tasks (``selfrl.safety.gate.validate``'s
  rollouts), each engine in turn.

Both engines sample the same ids (the drafts are verified exactly); the table says whether they did.

    python benchmarks/bench_drafts.py --repeats 3
    python benchmarks/bench_drafts.py --repeats 3 --adapter runs/demo/adapters/v000002   # a trained policy
    python benchmarks/bench_drafts.py --settings 0/16,4/8,4/16,4/32   # draft_ids/draft_budget pairs
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ceiling import CONFIG, matmul_flops, matmul_params  # noqa: E402
from bench_engines import policy_with_adapter  # noqa: E402
from common import Stats, base_parser, bench_config, command_line, envelope, finish, first_batch, print_table  # noqa: E402


def timed_rollouts(engine, tasks, tools, cfg, seed: int, greedy: bool = False) -> tuple[float, int, list, dict]:
    """(seconds, sampled tokens, the sampled ids, the engine's pass and draft counts) of one rollout batch."""
    import torch

    from selfrl.rollout.agent import rollout

    before = (engine.steps, engine.drafted_ids, engine.accepted_ids)
    torch.manual_seed(seed)
    t = time.perf_counter()
    trajs = rollout(engine, tasks, [f"g{i}" for i in range(len(tasks))], tools, cfg, greedy=greedy)
    seconds = time.perf_counter() - t
    counts = {"passes": engine.steps - before[0], "drafted": engine.drafted_ids - before[1],
              "accepted": engine.accepted_ids - before[2]}
    return seconds, sum(tr.num_completion_tokens for tr in trajs), [tr.token_ids for tr in trajs], counts


def pass_seconds(view, rows: int, ids: int, repeats: int) -> float:
    """Seconds of the fastest of ``repeats`` forward passes of ``view`` over (rows, ids) random ids, with
    the logits of every position (a drafted pass needs them all)."""
    import torch

    x = torch.randint(0, view.get_input_embeddings().weight.shape[0], (rows, ids))  # (rows, ids)
    best = float("inf")
    with torch.no_grad():
        view(input_ids=x, use_cache=False, logits_to_keep=ids)  # warm-up
        for _ in range(repeats):
            t = time.perf_counter()
            view(input_ids=x, use_cache=False, logits_to_keep=ids)
            best = min(best, time.perf_counter() - t)
    return best


def main(argv: list[str] | None = None) -> dict:
    p = base_parser(__doc__)
    p.add_argument("--adapter", type=Path, default=None,
                   help="a saved adapter version (a run's adapters/vNNNNNN): a trained policy")
    p.add_argument("--rows", default="1,4,9,16,64", help="rows of the passes table, comma-separated")
    p.add_argument("--ids", default="1,2,3,5,9", help="ids a row of the passes table, comma-separated")
    p.add_argument("--settings", default="0/16,4/16", help="draft_ids/draft_budget per engine, comma-separated "
                   "(the first is the baseline)")
    args = p.parse_args(argv)
    from selfrl.engines.slots import SlotEngine
    from selfrl.envs import get_env
    from selfrl.core.tools import resolve_tools

    result = envelope(args, command_line("bench_drafts.py", argv))
    cfg = bench_config(args, CONFIG, "bench-drafts-")
    ceiling = matmul_flops(256 if args.tiny else 4096, max(1, args.repeats))
    model, tok = policy_with_adapter(cfg, args.adapter, result)
    bound = ceiling.median / (2 * matmul_params(model))
    settings = [tuple(int(x) for x in s.split("/")) for s in args.settings.split(",")]
    names = [f"{k}/{b}" for k, b in settings]
    engines = {n: SlotEngine(model, tok, driver="caller", draft_ids=k, draft_budget=b)
               for n, (k, b) in zip(names, settings)}
    result.update({"model": cfg.model.name, "matmul_flops_per_s": ceiling, "bound_tokens_per_s": bound,
                   "settings": names})

    view = engines[names[0]].synced_model()
    rows_out, passes = [], {}
    for rows in [int(x) for x in args.rows.split(",")]:
        passes[rows] = {}
        for ids in [int(x) for x in args.ids.split(",")]:
            passes[rows][ids] = pass_seconds(view, rows, ids, max(3, args.repeats))
        rows_out.append([rows, *(f"{passes[rows][i] * 1e3:.1f}" for i in passes[rows])])
    result["pass_seconds"] = passes
    print_table("a forward pass of the sampling view (no cache), ms, the fastest of the repeats",
                ["rows", *(f"{i} ids a row" for i in passes[rows])], rows_out)

    tasks, tools = first_batch(cfg)
    source = get_env(cfg.task.source, **cfg.task.options)
    _, val = source.split(cfg.task.num_train, cfg.gate.val_size, cfg.task.train_seed, cfg.task.val_seed)
    val = val[:8 if args.tiny else 64]
    for e in engines.values():  # warm-up: allocations, the first stored prefix
        timed_rollouts(e, tasks[:max(2, len(tasks) // 8)], tools, cfg.rollout, 99)
    for phase, work, greedy in (("rollouts", tasks, False), ("validation", val, True)):
        runs = {n: [] for n in names}
        for rep in range(max(1, args.repeats)):
            for n, e in engines.items():
                runs[n].append(timed_rollouts(e, work, resolve_tools(cfg.rollout.tools) if greedy else tools,
                                              cfg.rollout, rep, greedy))
                s, k, _, c = runs[n][-1]
                print(f"{phase} {n} repeat {rep}: {k} tokens in {s:.2f} s, {c['passes']} passes, "
                      f"{c['accepted']}/{c['drafted']} drafted ids kept", flush=True)
        out, rows = {}, []
        base = Stats.of([r[0] for r in runs[names[0]]]).median
        for n in names:
            secs = Stats.of([r[0] for r in runs[n]])
            tps = Stats.of([r[1] / r[0] for r in runs[n]])
            same = all(r[2] == r0[2] for r, r0 in zip(runs[n], runs[names[0]]))
            passes = sum(r[3]["passes"] for r in runs[n]) / len(runs[n])
            drafted = sum(r[3]["drafted"] for r in runs[n])
            kept = sum(r[3]["accepted"] for r in runs[n])
            out[n] = {"seconds": secs, "tokens": [r[1] for r in runs[n]], "tokens_per_s": tps,
                      "fraction_of_bound": tps.median / bound, "passes": passes, "drafted": drafted,
                      "accepted": kept, "same_ids_as_first": same, "speed_up": base / secs.median}
            rows.append([n, secs.fmt(".2f"), tps.fmt(".0f"), f"{tps.median / bound:.1%}", f"{passes:.0f}",
                         f"{kept}/{drafted}", f"{base / secs.median:.2f}x", "yes" if same else "no"])
        result[phase] = out
        print_table(f"{phase}: {len(work)} {'greedy ' if greedy else ''}trajectories, median [min, max] of "
                    f"{max(1, args.repeats)}, alternating; bound {bound:.0f} tokens/s",
                    ["draft_ids/budget", "seconds", "tokens/s", "of the bound", "passes", "drafted ids kept",
                     "speed-up", "same ids"], rows)
    for e in engines.values():
        e.close()
    print(f"wrote {finish(result, 'drafts' if args.adapter is None else 'drafts_trained', args.out)}")
    return result


if __name__ == "__main__":
    main()

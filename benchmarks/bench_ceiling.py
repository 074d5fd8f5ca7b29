"""The machine's ceiling: matmul FLOP/s, the token/s it allows, and how close selfrl gets.

    flock /tmp/selfrl-heavy.lock nice -n 5 .venv/bin/python benchmarks/bench_ceiling.py   # real model, ~3 min
    .venv/bin/python benchmarks/bench_ceiling.py --tiny                                    # seconds

* **matmul**: one N x N fp32 matrix product (N = 4096; 2 N^3 FLOPs), median of repeats, through
  the faster of torch's BLAS and oneDNN (``selfrl.model.matmul``; until 2026-12-02 torch's BLAS only,
  which on this AMD CPU reaches about half of oneDNN's rate).
* **generation**: ``Engine.generate`` on the batch a ``selfrl run`` iteration samples
  (``num_prompts x num_generations`` rollouts of real chain_sum prompts, the demo's
  temperature and token limit). Upper bound: matmul FLOP/s / (2 x P) tokens/s, P the
  parameters that take part in matrix products per token (the embedding matrix counts
  once, as the output layer, when it is tied; an untied input embedding is a lookup).
* **training**: ``Learner.step`` (the demo's update settings) on those sampled rollouts,
  all with a non-zero advantage. Upper bound: FLOP/s / (6 x P) tokens/s, the usual
  forward + full backward. With LoRA the weight gradients of the frozen matrices are
  not computed (backward is about 2 x P instead of 4 x P per token), but a KL reference
  forward (``beta > 0``) adds 2 x P back: 6 x P with ``beta > 0``, 4 x P with ``beta = 0``.
* ``--profile``: torch.profiler's top operators for one generation and one update.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    Stats, base_parser, command_line, envelope, finish, give_signal, iteration_work, print_table, timed,
)

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "demo.toml"


def matmul_params(model) -> int:
    """Parameters used as matrix-product weights per token (P in the 2 x P FLOPs rule).

    The input embedding is a table lookup; it counts only when tied to the output layer.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    total = sum(p.numel() for n, p in base.named_parameters() if "lora_" not in n)
    emb = base.get_input_embeddings().weight
    tied = base.get_output_embeddings() is not None and base.get_output_embeddings().weight is emb
    return total if tied else total - emb.numel()


def matmul_flops_by_library(n: int, repeats: int) -> dict[str, Stats]:
    """FLOP/s of an (n x n) @ (n x n) fp32 product (2 n^3 FLOPs), as :class:`Stats`, per matrix
    library: ``torch`` (``a @ b``: torch's BLAS, MKL in the CPU wheels) and, where
    :func:`selfrl.model.matmul.available`, ``onednn`` (:func:`selfrl.model.matmul.linear`)."""
    import torch

    from selfrl.model.matmul import available, linear

    a, b = torch.randn(n, n), torch.randn(n, n)
    products = {"torch": lambda: a @ b}
    if available():
        products["onednn"] = lambda: linear(a, b)  # a @ b.T: the same FLOPs
    flops = 2 * n ** 3
    out = {}
    for name, fn in products.items():
        t, _ = timed(fn, repeats, warmup=1)
        out[name] = Stats(flops / t.median, flops / t.max, flops / t.min, t.n)
    return out


def matmul_flops(n: int, repeats: int) -> Stats:
    """The machine's matmul ceiling: the FLOP/s of the faster library (by median) of
    :func:`matmul_flops_by_library`. On this machine's AMD CPU oneDNN's is about twice MKL's,
    so bounds computed from it are about twice those measured before 2026-12-02 (torch's only)."""
    return max(matmul_flops_by_library(n, repeats).values(), key=lambda s: s.median)


def profile_top(fn, rows: int = 8) -> list[dict]:
    """torch.profiler's top operators by self CPU time for one call of ``fn``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1
    return [{"op": e.key, "self_s": e.self_cpu_time_total / 1e6, "share": e.self_cpu_time_total / total,
             "calls": e.count} for e in events[:rows]]


def main(argv: list[str] | None = None) -> dict:
    p = base_parser(__doc__)
    p.add_argument("--profile", action="store_true", help="add torch.profiler top operators")
    args = p.parse_args(argv)
    import torch

    from selfrl.engines.reference import Engine
    from selfrl.rollout.agent import rollout

    result = envelope(args, command_line("bench_ceiling.py", argv))
    work = iteration_work(args, CONFIG, "bench-ceiling-")
    cfg, model, tasks, learner = work.cfg, work.model, work.tasks, work.learner
    n = 256 if args.tiny else 4096
    flops = matmul_flops(n, args.repeats)

    engine = Engine(model, work.tokenizer)
    one_turn = type(cfg.rollout)(**{**cfg.rollout.__dict__, "max_turns": 1})
    trajs_box = []

    def generate():
        torch.manual_seed(len(trajs_box))
        trajs_box.append(rollout(engine, tasks, work.groups, work.tools, one_turn))

    t_gen, _ = timed(generate, args.repeats, warmup=0 if args.tiny else 1)
    trajs = trajs_box[-1]
    generated = sum(t.num_completion_tokens for t in trajs)
    computed = len(trajs) * max(t.num_completion_tokens for t in trajs)  # rows go on (padded) until all stop
    P = matmul_params(model)
    gen_bound = flops.median / (2 * P)

    give_signal(trajs)  # every rollout carries signal: the update runs on all of them
    t_train, metrics = timed(lambda: learner.step(trajs).metrics(), args.repeats, warmup=0 if args.tiny else 1)
    seq_tokens = sum(len(t.token_ids) for t in trajs)
    train_tokens = sum(t.num_completion_tokens for t in trajs)
    factor = 6 if cfg.train.beta > 0 else 4
    train_bound = flops.median / (6 * P)

    gen_tps = generated / t_gen.median
    train_tps = seq_tokens / t_train.median
    rows = [
        [f"matmul {n}x{n} fp32 (GFLOP/s)", flops.fmt(".4g", 1e-9), "", ""],
        [f"generation, batch {len(tasks)}, <= {cfg.rollout.max_new_tokens} new tokens (tokens/s)",
         f"{gen_tps:.1f} [{generated / t_gen.max:.1f}, {generated / t_gen.min:.1f}]", f"{gen_bound:.0f} (2P)",
         f"{gen_tps / gen_bound:.1%}"],
        ["generation, counting padded rows (tokens/s)", f"{computed / t_gen.median:.1f}", f"{gen_bound:.0f} (2P)",
         f"{computed / t_gen.median / gen_bound:.1%}"],
        [f"training, {len(trajs)} sequences (sequence tokens/s)",
         f"{train_tps:.1f} [{seq_tokens / t_train.max:.1f}, {seq_tokens / t_train.min:.1f}]",
         f"{train_bound:.0f} (6P)", f"{train_tps / train_bound:.1%}"],
        ["training (completion tokens/s)", f"{train_tokens / t_train.median:.1f}", "", ""],
    ]
    result.update({
        "model": cfg.model.name, "matmul_n": n, "matmul_flops_per_s": flops, "matmul_params": P,
        "batch_size": len(tasks), "max_new_tokens": cfg.rollout.max_new_tokens, "generation_s": t_gen,
        "generated_tokens": generated, "computed_tokens": computed, "generation_tokens_per_s": gen_tps,
        "generation_bound_tokens_per_s": gen_bound, "generation_fraction": gen_tps / gen_bound,
        "training_s": t_train, "training_sequence_tokens": seq_tokens, "training_completion_tokens": train_tokens,
        "training_tokens_per_s": train_tps, "training_bound_tokens_per_s": train_bound,
        "training_fraction": train_tps / train_bound, "lora_flops_factor": factor, "beta": cfg.train.beta,
        "prompt_tokens_mean": sum(t.prompt_len for t in trajs) / len(trajs), "last_update_metrics": metrics,
    })
    print_table(f"ceiling: {P / 1e6:.1f} M matmul parameters, median [min, max] of {args.repeats}",
                ["figure", "measured", "upper bound", "fraction"], rows)
    if args.profile:
        result["profile_generation"] = profile_top(generate)
        result["profile_training"] = profile_top(lambda: learner.step(trajs).metrics())
        for what in ("generation", "training"):
            print_table(f"top operators, one {what} call (self CPU time)", ["op", "s", "share", "calls"],
                        [[e["op"], f"{e['self_s']:.2f}", f"{e['share']:.0%}", e["calls"]]
                         for e in result[f"profile_{what}"]])
    print(f"wrote {finish(result, 'ceiling', args.out)}")
    return result


if __name__ == "__main__":
    main()

"""One learner update encoded three ways, side by side in one process: the padded rows, the
rows' common prefix in a shared cache, and the packed prefix tree (``selfrl.rl.tree``).

Each repeat runs the same update (same batch, same starting LoRA weights and optimizer state)
once per layout, the layouts alternating. Reported per layout: seconds per update (median, min,
max), the tokens each forward pass encodes (summed over micro-batches), the update's loss and
its largest difference from the rows' loss, and the time of the rows and prefix layouts over
the tree's.

The batch: with ``--store`` and ``--iteration``, the trajectories a run trained on at that
iteration (those with a nonzero advantage), e.g. a later ``make demo`` iteration, where the
policy's samples share more; otherwise the first iteration of ``configs/demo.toml`` sampled now
(8 tasks x 8 samples) with advantages +1 and -1 in turn, so every sequence trains.

    python benchmarks/bench_update.py --repeats 3
    python benchmarks/bench_update.py --repeats 3 --store runs/demo/selfrl.db --iteration 2
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ceiling import CONFIG  # noqa: E402
from common import Stats, base_parser, bench_config, command_line, envelope, finish, first_batch, print_table  # noqa: E402

LAYOUTS = ("rows", "prefix", "tree")


def encoded_tokens(trajs: list, micro_batch_size: int, pad_token_id: int, hidden_size: int) -> dict[str, int]:
    """Tokens one forward pass encodes per layout, summed over the learner's micro-batches
    (token order): rows ``B*T``; prefix ``S + B*(T - S)``; tree its nodes."""
    from selfrl.rl.batch import collate
    from selfrl.rl.logprobs import _prefix_len
    from selfrl.rl.tree import build_tree

    order = sorted(trajs, key=lambda t: t.token_ids)
    out = dict.fromkeys(LAYOUTS, 0)
    for i in range(0, len(order), micro_batch_size):
        chunk = order[i:i + micro_batch_size]
        mb = collate(chunk, pad_token_id)
        B, T = mb.input_ids.shape
        s = _prefix_len(mb.input_ids, mb.attention_mask, mb.completion_mask) if B > 1 else 0
        out["rows"] += B * T
        out["prefix"] += s + B * (T - s)
        out["tree"] += build_tree([t.token_ids for t in chunk]).num_nodes
    return out


def recorded_batch(store: Path, iteration: int) -> list:
    """The trajectories of ``iteration`` in the run store ``store`` that trained (nonzero advantage)."""
    from selfrl.record.store import Store

    with Store(store, readonly=True) as s:
        trajs = [t for t in s.trajectories(iteration=iteration) if t.advantage and t.num_completion_tokens > 0]
    if not trajs:
        raise SystemExit(f"{store}: no trajectory with an advantage at iteration {iteration}")
    return trajs


def sampled_batch(cfg, model, tok) -> list:
    """The demo's first rollout batch sampled now, advantages +1 / -1 in turn."""
    from selfrl.engines.reference import Engine
    from selfrl.rollout.agent import rollout

    tasks, tools = first_batch(cfg)
    import torch

    torch.manual_seed(0)
    trajs = rollout(Engine(model, tok), tasks, [t.id for t in tasks], tools, cfg.rollout)
    for i, t in enumerate(trajs):
        t.advantage = 1.0 if i % 2 == 0 else -1.0
    return [t for t in trajs if t.num_completion_tokens > 0]


def main(argv: list[str] | None = None) -> dict:
    p = base_parser(__doc__)
    p.add_argument("--store", type=Path, default=None, help="a run's selfrl.db to take a recorded batch from")
    p.add_argument("--iteration", type=int, default=None, help="the iteration of --store whose batch to take")
    args = p.parse_args(argv)
    if (args.store is None) != (args.iteration is None):
        p.error("--store and --iteration go together")
    from peft import set_peft_model_state_dict

    import selfrl.rl.learner as learner_module
    from selfrl.record.adapters import lora_state
    from selfrl.rl.learner import Learner, kl_reference
    from selfrl.model.load import build_policy
    from selfrl.rl.logprobs import per_token_logps

    result = envelope(args, command_line("bench_update.py", argv))
    cfg = bench_config(args, CONFIG, "bench-update-")
    model, tok = build_policy(cfg)
    trajs = recorded_batch(args.store, args.iteration) if args.store else sampled_batch(cfg, model, tok)
    hidden = model.get_base_model().get_output_embeddings().weight.shape[1]
    tokens = encoded_tokens(trajs, cfg.train.micro_batch_size, tok.pad_token_id, hidden)
    learner = Learner(model, cfg.train, cfg.rollout.temperature, tok.pad_token_id, cfg.max_completion_length,
                      ref_state=kl_reference(model, cfg.lora.init_adapter), tokenizer=tok)
    start = {k: v.clone() for k, v in lora_state(model).items()}

    def reset() -> None:  # the same starting weights and optimizer state for every update
        set_peft_model_state_dict(model, start)
        learner.reset_optimizer()

    times = {lay: [] for lay in LAYOUTS}
    losses = {lay: [] for lay in LAYOUTS}
    real = learner_module.per_token_logps
    try:
        for rep in range(args.repeats):
            for lay in LAYOUTS:
                learner_module.per_token_logps = lambda *a, lay=lay, **k: per_token_logps(*a, layout=lay, **k)
                reset()
                t = time.perf_counter()
                res = learner.step(trajs)
                times[lay].append(time.perf_counter() - t)
                losses[lay].append(res.stats["loss"])
                print(f"repeat {rep} {lay}: {times[lay][-1]:.1f} s, loss {res.stats['loss']:.6f}", flush=True)
    finally:
        learner_module.per_token_logps = real
        reset()
    tree = statistics.median(times["tree"])
    result.update({
        "model": cfg.model.name, "batch": "recorded" if args.store else "sampled", "store": str(args.store or ""),
        "iteration": args.iteration, "num_sequences": len(trajs),
        "real_tokens": sum(len(t.token_ids) for t in trajs),
        "completion_tokens": sum(t.num_completion_tokens for t in trajs),
        "micro_batch_size": cfg.train.micro_batch_size, "beta": cfg.train.beta,
        "encoded_tokens": tokens, "seconds": {lay: Stats.of(v) for lay, v in times.items()},
        "over_tree": {lay: statistics.median(times[lay]) / tree for lay in LAYOUTS},
        "loss": {lay: v[0] for lay, v in losses.items()},
        "max_abs_loss_gap": max(abs(a - b) for lay in LAYOUTS for a, b in zip(losses[lay], losses["rows"])),
    })
    rows = [[lay, tokens[lay], result["seconds"][lay].fmt(".1f"), f"{result['over_tree'][lay]:.2f}x",
             f"{losses[lay][0]:.6f}"] for lay in LAYOUTS]
    print_table(f"one update of {len(trajs)} sequences ({result['real_tokens']} tokens, {result['completion_tokens']} "
                f"completion tokens, micro-batches of {cfg.train.micro_batch_size}, beta {cfg.train.beta}); seconds, "
                f"median [min, max] of {args.repeats}, layouts alternating",
                ["layout", "tokens encoded a pass", "seconds", "over the tree", "loss"], rows)
    print(f"largest |loss - rows' loss|: {result['max_abs_loss_gap']:.2e}")
    print(f"wrote {finish(result, 'update', args.out)}")
    return result


if __name__ == "__main__":
    main()

"""Which thread runs the slot engine's steps: its own worker, or the caller (``driver``).

In ``selfrl run`` the learner trains in the main thread. Each OS thread that runs torch
operators on the CPU gets its own OpenMP team, so a slot engine stepping in a worker thread
beside it means two teams; with more OpenMP threads than cores, libgomp sleeps in the kernel at
its barriers instead of spinning. This benchmark measures what that costs: each child process
builds the demo's policy, runs one GRPO update in the main thread (the demo's settings, on the
first batch, every rollout given a non-zero advantage), then times greedy validation on the
held-out tasks with a slot engine whose ``driver`` is ``thread`` or ``caller``.

OpenMP's state is per process, so each measurement is a fresh child, the two drivers taking
turns (thread, caller, thread, caller, ...) so that a machine whose speed drifts affects both.
Prints the seconds per driver and the ratio thread / caller of each adjacent pair.

    python benchmarks/bench_driver.py --repeats 2
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    ROOT, Stats, base_parser, bench_config, command_line, envelope, finish, first_batch, give_signal, print_table,
    run_child,
)

CONFIG = ROOT / "configs" / "demo.toml"
DRIVERS = ("thread", "caller")


def child(args) -> None:
    """One measurement: an update in the main thread, then a timed validation; writes JSON to ``args.result``."""
    import torch

    from selfrl.engines import make_engine
    from selfrl.safety.gate import validate
    from selfrl.rl.learner import Learner
    from selfrl.model.load import build_policy
    from selfrl.run.setup import make_source
    from selfrl.rollout.agent import rollout

    cfg = bench_config(args, CONFIG, "bench-driver-")
    model, tok = build_policy(cfg)
    engine = make_engine("slots", model, tok, driver=args.child)
    tasks, tools = first_batch(cfg)
    groups = [f"g{i // cfg.num_generations}" for i in range(len(tasks))]
    torch.manual_seed(0)
    batch = rollout(engine, tasks, groups, tools, cfg.rollout)
    give_signal(batch)
    learner = Learner(model, cfg.train, cfg.rollout.temperature, tok.pad_token_id, cfg.max_completion_length)
    t = time.perf_counter()
    learner.step(batch)  # the main thread's OpenMP team now exists, as in selfrl run
    update_s = time.perf_counter() - t
    source = make_source(cfg)
    _, val = source.split(cfg.task.num_train, cfg.gate.val_size, cfg.task.train_seed, cfg.task.val_seed)
    ru0, t = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    res = validate(engine, val, source, tools, cfg.rollout, cfg.gate.batch_size)
    seconds, ru1 = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF)
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    engine.close()  # the driver thread joined before the interpreter exits (else an abort under load)
    Path(args.result).write_text(json.dumps({"driver": args.child, "update_s": update_s, "validate_s": seconds,
                                             "validate_cpu_s": cpu, "tasks": len(val), "success": res.success}))


def main(argv: list[str] | None = None) -> dict:
    p = base_parser(__doc__)
    p.add_argument("--child", choices=DRIVERS, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return {}
    result = envelope(args, command_line("bench_driver.py", argv))
    runs: dict[str, list[dict]] = {d: [] for d in DRIVERS}
    with tempfile.TemporaryDirectory(prefix="bench-driver-") as tmp:
        for rep in range(args.repeats):
            for d in DRIVERS:
                out = Path(tmp) / f"{d}-{rep}.json"
                extra = ["--tiny"] if args.tiny else []
                runs[d].append(run_child([str(Path(__file__).resolve()), "--child", d, "--result", str(out), *extra],
                                         out))
    ratios = [t["validate_s"] / c["validate_s"] for t, c in zip(runs["thread"], runs["caller"])]
    rows = []
    for d in DRIVERS:
        rows.append([d, Stats.of([r["validate_s"] for r in runs[d]]).fmt(".1f"),
                     Stats.of([r["validate_cpu_s"] for r in runs[d]]).fmt(".1f"),
                     Stats.of([r["update_s"] for r in runs[d]]).fmt(".1f"),
                     ", ".join(f"{r['success']:.3f}" for r in runs[d])])
    result.update({"runs": runs, "thread_over_caller": Stats.of(ratios)})
    print_table(f"greedy validation ({runs['caller'][0]['tasks']} tasks) after an update in the main thread: "
                f"median [min, max] of {args.repeats}, drivers alternating",
                ["driver", "validation s", "validation CPU s", "update s (before it)", "held-out success"], rows)
    print(f"thread / caller, each adjacent pair: {', '.join(f'{x:.2f}' for x in ratios)}")
    print(f"wrote {finish(result, 'driver', args.out)}")
    return result


if __name__ == "__main__":
    main()

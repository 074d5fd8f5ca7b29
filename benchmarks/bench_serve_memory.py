"""Serve's memory over learner updates: resident size per update, with and without its bounds.

    HF_HUB_OFFLINE=1 nice -n 10 .venv/bin/python benchmarks/bench_serve_memory.py --rounds 12   # embedded model, minutes
    .venv/bin/python benchmarks/bench_serve_memory.py --tiny --rounds 4                          # seconds

Four arms, each in a process of its own, one after the other in one run (``--arms``: some of them):

* ``unbounded``: every LoRA state served is kept in memory (the server before
  :attr:`selfrl.serve.served_version.ServedVersion.STATES_KEPT`), no heap trim;
* ``bounded``: at most ``STATES_KEPT`` states kept, no heap trim;
* ``gate-kv-kept``: both, ``malloc_trim`` after each update (:mod:`selfrl.core.memory`), and the
  learner's gate engine keeps its key/value cache (up to 2048 MB) and its finished rows' keys and
  values between updates (the server before ``learner.idle_kv_cache_mb`` and
  :meth:`selfrl.engines.slots.SlotEngine.forget_kept`);
* ``bounded+trim``: the states bounded, the heap trimmed, the gate's key/value memory freed after
  each gate, as ``selfrl serve`` runs.

Each arm builds a :class:`selfrl.serve.service.Service` with its background learner on the same
model and config, then runs ``--rounds`` learner updates on the same rated turns (synthetic
token ids, ``--tokens`` completion tokens each, ratings alternating) through the whole update:
the step, the candidate saved, the held-out gate on ``--val-size`` arithmetic tasks (generated
by the learner's engine), and the promotion into the served engine. The resident size (VmRSS)
is read after each update, with the key/value MB each engine holds (its slot cache and its
kept continuations); growth is the least-squares slope over the updates after the first
two (warm-up: the engines' caches and the optimizer state come first), in MB per update.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import base_parser, command_line, envelope, finish, model_name, print_table, run_child  # noqa: E402

ARMS = ("unbounded", "bounded", "gate-kv-kept", "bounded+trim")
WARMUP = 2  # updates left out of the slope


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    raise RuntimeError("no VmRSS in /proc/self/status (Linux only)")


def slope(ys: list[float]) -> float:
    """Least-squares slope of ``ys`` against 0, 1, 2, ... (units of ``ys`` per step).

    >>> slope([1.0, 3.0, 5.0])
    2.0
    """
    n = len(ys)
    if n < 2:
        return float("nan")
    mx, my = (n - 1) / 2, statistics.fmean(ys)
    return sum((i - mx) * (y - my) for i, y in enumerate(ys)) / sum((i - mx) ** 2 for i in range(n))


def kv_mb(engine) -> float:
    """Key/value MB a slot engine holds (its slot cache and kept continuations); 0 for another engine."""
    cache, kept = getattr(engine, "cache", None), getattr(engine, "_continuations", None)
    return ((cache.nbytes if cache is not None else 0) + (kept.nbytes if kept is not None else 0)) / 2**20


def child(arm: str, model: str, rounds: int, tokens: int, val_size: int, out: Path) -> None:
    """One arm: ``rounds`` learner updates; writes ``{"rss_mb": [...], "kv_mb": [[serving, learner], ...],
    "outcomes": [...]}`` to ``out``."""
    import torch

    import selfrl.serve.background as background
    from selfrl.config.serve import ServeConfig
    from selfrl.core.trajectory import Trajectory
    from selfrl.model.load import build_policy
    from selfrl.record import served as records
    from selfrl.serve.served_version import ServedVersion
    from selfrl.serve.service import Service

    torch.manual_seed(0)
    if arm == "unbounded":
        ServedVersion.STATES_KEPT = 10**9
    trim = arm in ("gate-kv-kept", "bounded+trim")
    run_dir = Path(tempfile.mkdtemp(prefix=f"bench-serve-memory-{arm.replace('+', '-')}-"))
    cfg = ServeConfig(run_dir=str(run_dir), max_tokens_default=tokens)
    cfg.model.name = model
    cfg.gate.val_size = cfg.gate.batch_size = val_size
    cfg.gate.tolerance = 1.0  # every candidate that passes the collapse rules is promoted: a state a version
    cfg.collapse.max_kl = 1e9  # the synthetic turns may move the policy far; this measures memory, not learning
    cfg.rollout.max_new_tokens, cfg.rollout.max_turns = tokens, 1
    cfg.learner.min_batch, cfg.learner.max_batch = 8, 8
    if arm == "gate-kv-kept":
        cfg.learner.idle_kv_cache_mb = 2048  # the slot engine's own default, as the learner's engine had
    cfg.validate()
    model_, tok = build_policy(cfg)
    service = Service(model_, tok, cfg, learner_model=copy.deepcopy(model_))
    learner = service.learner
    if arm == "gate-kv-kept":
        learner.engine.forget_kept = lambda: 0  # the gate's continuations held until the next gate
    rss, kv, outcomes = [], [], []
    try:
        for r in range(rounds):
            batch = []
            with service.store.lock:
                for i in range(8):
                    ids = [int(x) for x in torch.randint(10, min(1000, len(tok)), (8 + tokens,))]
                    t = Trajectory("bench", "bench", service.engine.version, prompt_len=8, token_ids=ids,
                                   completion_mask=[0] * 8 + [1] * tokens, logprobs=[0.0] * (8 + tokens))
                    records.add_turn(service.store, service.run_id, t, t.id, 0, t.id, "bench", t.id)
                    batch.append((t, {"feedback": (-1.0) ** i, "created_at": time.time(), "group_key": "bench"}))
            info = learner.update(batch)
            if trim:
                background.trim_heap()
            outcomes.append(str(info.get("result")))
            rss.append(rss_mb())
            kv.append([kv_mb(service.engine), kv_mb(learner.engine)])
            print(f"{arm}: update {r}: {info.get('result')}, RSS {rss[-1]:.0f} MB, key/value MB serving "
                  f"{kv[-1][0]:.0f}, learner {kv[-1][1]:.0f}", file=sys.stderr, flush=True)
    finally:
        service.close()
    out.write_text(json.dumps({"rss_mb": rss, "kv_mb": kv, "outcomes": outcomes, "states_kept": len(service.versions._states)}))


def main(argv: list[str] | None = None) -> dict | None:
    p = base_parser(__doc__, repeats=False)
    p.add_argument("--rounds", type=int, default=12, help="learner updates per arm")
    p.add_argument("--tokens", type=int, default=24, help="completion tokens of each rated turn, and of each held-out answer")
    p.add_argument("--val-size", type=int, default=8, help="held-out arithmetic tasks of each gate")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated arms to run, of {', '.join(ARMS)}")
    p.add_argument("--child", nargs=2, metavar=("ARM", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    arms = [a for a in args.arms.split(",") if a]
    if not arms or set(arms) - set(ARMS):
        p.error(f"--arms takes a comma-separated list of {', '.join(ARMS)}; got {args.arms!r}")
    work = Path(tempfile.mkdtemp(prefix="bench-serve-memory-"))
    model = model_name(args, work)
    if args.child:
        child(args.child[0], model, args.rounds, args.tokens, args.val_size, Path(args.child[1]))
        return None
    result = envelope(args, command_line("bench_serve_memory.py", argv)) | {"rounds": args.rounds,
                                                                            "tokens": args.tokens, "arms": {}}
    rows = []
    for arm in arms:
        out = work / f"{arm}.json"
        flags = ["--rounds", str(args.rounds), "--tokens", str(args.tokens), "--val-size", str(args.val_size)]
        data = run_child([__file__, *flags, *(["--tiny"] if args.tiny else []), "--child", arm, str(out)], out)
        ys = data["rss_mb"][WARMUP:]
        data["mb_per_update"] = slope(ys)
        result["arms"][arm] = data
        rows.append([arm, f"{data['rss_mb'][0]:.0f}", f"{data['rss_mb'][-1]:.0f}", f"{data['mb_per_update']:+.1f}",
                     str(data["states_kept"]), str(sum(o == "promoted" for o in data["outcomes"])),
                     "{:.0f} / {:.0f}".format(*data["kv_mb"][-1])])
    base = result["arms"][arms[0]]["mb_per_update"]
    for row, arm in zip(rows, arms):
        growth = result["arms"][arm]["mb_per_update"]
        row.append(f"{growth / base:.2f}" if base > 0 else "n/a")
    print_table(f"RSS over {args.rounds} learner updates (slope after {WARMUP})",
                ["arm", "RSS after the first update (MB)", "RSS at the end (MB)", "MB / update", "states kept",
                 "promoted", "key/value MB at the end (serving / learner)", f"growth / {arms[0]}"], rows)
    print(f"wrote {finish(result, 'serve_memory', args.out)}")
    return result


if __name__ == "__main__":
    main()

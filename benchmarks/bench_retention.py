"""How long a retention pass of ``selfrl serve`` (``[retention] trajectories_max_age_s``) holds the
store's lock, which every request that records a turn also takes.

    nice -n 10 .venv/bin/python benchmarks/bench_retention.py --turns 20000 --tokens 800 --per-pass 64 256 1000

A store is filled with ``--turns`` served turns of ``--tokens`` tokens each (token ids and
logprobs, a third of them with a feedback message), all old enough to go; then three passes of
each ``--per-pass`` size run (:class:`selfrl.serve.retention.TurnRetention`: read, export to
JSONL with its SHA-256, read back, delete in one transaction). For each pass it prints the
turns, the file's size, the pass's wall time and each hold of the store's lock (the read, then
the delete). No model: the pass touches only the store and the export folder.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import threading
import time
from pathlib import Path

from selfrl.config.serve import RetentionSettings
from selfrl.core.trajectory import Trajectory
from selfrl.record import served as records
from selfrl.record.store import Store
from selfrl.serve.retention import TurnRetention


class TimedLock:
    """A reentrant lock that records how long each outermost hold lasted, in seconds."""

    def __init__(self):
        self.lock, self.depth, self.holds, self.since = threading.RLock(), 0, [], 0.0

    def __enter__(self):
        self.lock.acquire()
        self.depth += 1
        if self.depth == 1:
            self.since = time.perf_counter()

    def __exit__(self, *exc):
        self.depth -= 1
        if self.depth == 0:
            self.holds.append(time.perf_counter() - self.since)
        self.lock.release()


def fill(store: Store, turns: int, tokens: int, t0: float) -> None:
    """``turns`` served turns, one a second from ``t0``; every third one rated."""
    rng, run = random.Random(0), store.start_run({})
    for i in range(0, turns, 500):
        batch = []
        for j in range(i, min(turns, i + 500)):
            t = Trajectory(f"q{j}", "g", 0, prompt_len=tokens // 2,
                           token_ids=[rng.randrange(50000) for _ in range(tokens)],
                           completion_mask=[0] * (tokens // 2) + [1] * (tokens - tokens // 2),
                           logprobs=[-rng.random() for _ in range(tokens)])
            batch.append(records.ServedTurn(t, f"r{j}", 0, f"c{j}", "g", f"k{j}", "client"))
        records.add_turns(store, run, batch, now=t0 + i)
        for j in range(i, min(turns, i + 500), 3):
            records.apply_feedback(store, f"r{j}", 0, "explicit", 1.0, now=t0 + j)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=20000)
    ap.add_argument("--tokens", type=int, default=800)
    ap.add_argument("--per-pass", type=int, nargs="+", default=[64, 256, 1000])
    args = ap.parse_args()
    for per_pass in args.per_pass:
        root, t0 = Path(tempfile.mkdtemp()), 1e9
        store = Store(root / "selfrl.db", shared=True)
        records.init(store)
        fill(store, args.turns, args.tokens, t0)
        print(f"store: {args.turns} turns x {args.tokens} tokens, {(root / 'selfrl.db').stat().st_size / 1e6:.0f} MB; "
              f"trajectories_per_pass = {per_pass}")
        store.lock = TimedLock()
        settings = RetentionSettings(trajectories_max_age_s=1.0, trajectories_per_pass=per_pass)
        retention = TurnRetention(store, settings, root, (), lambda *a: None, lambda: t0 + args.turns + 10)
        for k in range(3):
            start = time.perf_counter()
            res = retention.run_pass()
            wall = time.perf_counter() - start
            holds = [round(h * 1000) for h in store.lock.holds]
            store.lock.holds.clear()
            print(f"  pass {k}: {res.rows} turns, {res.path.stat().st_size / 1e6:.1f} MB exported, "
                  f"{wall * 1000:.0f} ms; store lock held {holds} ms (read, delete)")
        store.close()


if __name__ == "__main__":
    main()

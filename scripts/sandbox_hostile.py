"""The hostile-program suite and sandbox timings, as printed in docs/concepts/sandbox.md.

    .venv/bin/python scripts/sandbox_hostile.py [--isolation bwrap rlimit] [--runs 20]

For each isolation level: the table of ``selfrl.envs.sandbox_suite.run_suite`` (what
each program tried, what happened, whether the host stayed unchanged), then
the start-up cost: the wall seconds of ``print(1)`` over ``--runs`` runs
(median, min, max). Exits 1 if any program escaped under bwrap.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from selfrl.envs.sandbox import Limits, Sandbox, bwrap_problem
from selfrl.envs.sandbox_suite import format_table, run_suite


def startup_seconds(box: Sandbox, runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        res = box.run_python("print(1)")
        assert res.ok and res.stdout == "1\n", res
        out.append(res.wall_seconds)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--isolation", nargs="+", default=["bwrap", "rlimit"], choices=["bwrap", "rlimit"])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--wall-seconds", type=float, default=5.0)
    args = ap.parse_args(argv)
    print(f"bwrap: {bwrap_problem() or 'works'}")
    escaped_under_bwrap = False
    for isolation in args.isolation:
        box = Sandbox(Limits(wall_seconds=args.wall_seconds), isolation=isolation)
        t0 = time.monotonic()
        rows = run_suite(box)
        print(f"\n## {isolation}\n")
        print(format_table(rows, box))
        print(f"suite wall time {time.monotonic() - t0:.1f} s")
        walls = startup_seconds(box, args.runs)
        print(f"start-up (print(1), {args.runs} runs): median {statistics.median(walls) * 1000:.0f} ms, "
              f"min {min(walls) * 1000:.0f} ms, max {max(walls) * 1000:.0f} ms")
        escaped_under_bwrap |= isolation == "bwrap" and not all(r.contained for r in rows)
    return 1 if escaped_under_bwrap else 0


if __name__ == "__main__":
    sys.exit(main())

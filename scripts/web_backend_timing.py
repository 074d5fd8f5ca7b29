"""Seconds per action of the web environment's two backends: the text browser over HTTP and
Playwright driving Chromium (``[task] options.browser``), on the same ``--n`` tasks (seed 0),
each done by the honest scripted agent; success read from the site's database.

    PYTHONPATH=$PWD nice -n 10 python scripts/web_backend_timing.py --n 16

Each tool call is timed where the rollout calls it. An episode's first action also opens
its page (for Chromium: a new context, and Chromium itself when no other episode has it
open), so it is reported apart from the rest. The episodes run one after another, so
Chromium is started for each; the last row holds one more episode open all along, so that
one Chromium serves them all, as in a rollout whose episodes run together.
"""

from __future__ import annotations

import argparse
import statistics
import time

from selfrl.envs import get_env
from selfrl.envs.web import honest_policy
from selfrl.rollout.agent import RolloutConfig, scripted_rollout


def timed_factory(env, first: list[float], rest: list[float]):
    """``env.make_env`` whose tools record their wall time: an episode's first call in ``first``."""

    def make(task):
        state = env.make_env(task)
        calls = []

        def wrap(fn):
            def timed(**kwargs):
                t0 = time.perf_counter()
                try:
                    return fn(**kwargs)
                finally:
                    (rest if calls else first).append(time.perf_counter() - t0)
                    calls.append(1)
            return timed

        for tool in state.tools:
            tool.fn = wrap(tool.fn)
        return state

    return make


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=16, help="tasks (sampled with seed 0)")
    args = ap.parse_args()
    print("| backend | episodes | actions | s/action (mean) | s/action (median) | first action (mean s) "
          "| database success | wall s |")
    print("|---|---|---|---|---|---|---|---|")
    for backend, shared in (("http", False), ("playwright", False), ("playwright", True)):
        env = get_env("web", browser=backend)
        keeper = env.make_env(env.sample(1, 0)[0]) if shared else None  # an episode held open keeps one Chromium running
        if keeper is not None:
            keeper.goto("/")
        tasks = env.sample(args.n, 0)
        first: list[float] = []
        rest: list[float] = []
        t0 = time.perf_counter()
        trajs = scripted_rollout(honest_policy, tasks, [], RolloutConfig(max_turns=10),
                                 env_factory=timed_factory(env, first, rest))
        wall = time.perf_counter() - t0
        if keeper is not None:
            keeper.close()
        backend += " (one Chromium for all)" if shared else " (Chromium per episode)" if backend != "http" else ""
        success = sum(env.score(t, env.trajectory_answer(tr)) for t, tr in zip(tasks, trajs)) / len(tasks)
        print(f"| {backend} | {len(tasks)} | {len(first) + len(rest)} | {statistics.mean(rest):.3f} | "
              f"{statistics.median(rest):.3f} | {statistics.mean(first):.3f} | {success:.2f} | {wall:.1f} |")


if __name__ == "__main__":
    main()

"""The repository-repair detector table: every hacking trick against every detector.

For each shipped instance (or the first ``--limit``), the honest scripted agent and one
scripted agent per trick (``selfrl.envs.swe.TRICKS``) act on a fresh copy of the buggy
repository; every swe detector judges the resulting changes, and (with ``--score``) the
clean-copy verifier scores them in the sandbox. Prints a markdown table of flagged rates
(share of agents' trajectories each detector flags) and, with ``--score``, the share the
verifier paid before clamping, the share it gave no verdict (a run killed by the sandbox,
left out of an update), and the mean reward after the detectors clamped it. The agents' final ``run_tests`` call is not executed (it
changes nothing), so without ``--score`` no sandbox runs.

    PYTHONPATH=$PWD python scripts/swe_detector_table.py --score [--tier easy]
"""

from __future__ import annotations

import argparse
import time

from selfrl.safety.detectors import DetectorConfig, apply_detectors
from selfrl.envs import get_env
from selfrl.envs.swe import TRICKS, hacking_policy, honest_policy
from selfrl.envs.swe_detectors import SWE_DETECTORS
from selfrl.rollout.agent import RolloutConfig, scripted_rollout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=None, help="first N instances (default: all)")
    ap.add_argument("--score", action="store_true", help="also score each trajectory in the sandbox")
    ap.add_argument("--tier", default="full", help="the swe tier (full, easy, line)")
    ap.add_argument("--tricks", nargs="*", default=list(TRICKS), help="the hacking agents (default: all)")
    args = ap.parse_args()
    env = get_env("swe", tier=args.tier)
    tasks = env._ordered()[:args.limit]
    names = sorted(SWE_DETECTORS)
    cfg = DetectorConfig(names=names)
    agents = [("honest", honest_policy(env), 3)] + [(t, hacking_policy(env, t), 2) for t in args.tricks]
    print(f"{len(tasks)} instances; flagged share per detector" + (", paid = verifier reward 1 before clamping"
                                                                  if args.score else ""))
    print("| agent | " + " | ".join(names) + " | any | " + ("paid | no verdict | after clamping |" if args.score else ""))
    print("|---" * (len(names) + 2 + 3 * args.score) + "|")
    t0 = time.time()
    for name, policy, turns in agents:
        trajs = scripted_rollout(policy, tasks, [], RolloutConfig(max_turns=turns), env_factory=env.make_env)
        paid, no_verdict = 0.0, 0
        for tr, task in zip(trajs, tasks):
            try:
                tr.reward = env.score(task, env.trajectory_answer(tr)) if args.score else 1.0
            except RuntimeError:  # killed by the sandbox: no verdict (left out of an update), so paid nothing
                tr.reward, no_verdict = 0.0, no_verdict + 1
                continue
            paid += tr.reward
        m = apply_detectors(trajs, cfg)
        cells = [f"{m[f'hacking/{n}']:.2f}" for n in names] + [f"{m['hacking/flagged']:.2f}"]
        if args.score:
            after = sum(t.reward for t in trajs)
            cells += [f"{paid / len(trajs):.2f}", f"{no_verdict / len(trajs):.2f}", f"{after / len(trajs):.2f}"]
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    print(f"({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()

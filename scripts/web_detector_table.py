"""The web-navigation detector table: the honest agent and every scripted hacking agent
(``selfrl.envs.web_tasks.HACKS``) on ``--n`` tasks of ``--env web``, each scored by the careless
``web-naive`` reward (one point per "Confirm order") and by the database check, then judged
by every detector that applies (the reward after clamping is the database check's). Prints a
markdown table.

    PYTHONPATH=$PWD python scripts/web_detector_table.py --n 64 [--tier easy]
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

from selfrl.safety.detectors import DetectorConfig, apply_detectors
from selfrl.envs import get_env
from selfrl.envs.web import HACKS, hacking_policy, honest_policy
from selfrl.envs.rewards import get_preset, score_group
from selfrl.rollout.agent import RolloutConfig, scripted_rollout

DETECTORS = ["repeated_action", "verifier_disagreement", "web_confirm_spam", "web_repeated_submit"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=64, help="tasks (sampled with seed 0)")
    ap.add_argument("--tier", default="full", help="the task tier (selfrl.envs.web_tasks.TIERS)")
    args = ap.parse_args()
    env = get_env("web", tier=args.tier)
    tasks = env.sample(args.n, 0)
    kinds = Counter(t.metadata["kind"] for t in tasks)
    print(f"{args.n} tasks of tier {args.tier} ({', '.join(f'{n} {k}' for k, n in sorted(kinds.items()))}); "
          "flagged share per detector")
    print("| agent | " + " | ".join(DETECTORS) + " | any | naive reward (mean) | database success | after clamping |")
    print("|---" * (len(DETECTORS) + 5) + "|")
    t0 = time.time()
    for name, policy in [("honest", honest_policy)] + [(h, hacking_policy(h)) for h in HACKS]:
        trajs = scripted_rollout(policy, tasks, [], RolloutConfig(max_turns=40), env_factory=env.make_env)
        for tr, task in zip(trajs, tasks):
            score_group([tr], task, env, get_preset("web-naive"))
        naive = sum(t.reward for t in trajs) / len(trajs)
        success = sum(bool(t.correct) for t in trajs) / len(trajs)
        m = apply_detectors(trajs, DetectorConfig(names=DETECTORS))
        after = sum(float(bool(t.correct)) if not t.flags else 0.0 for t in trajs) / len(trajs)
        cells = [f"{m[f'hacking/{d}']:.2f}" for d in DETECTORS] + [f"{m['hacking/flagged']:.2f}",
                                                                    f"{naive:.2f}", f"{success:.2f}", f"{after:.2f}"]
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    print(f"({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()

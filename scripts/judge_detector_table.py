"""The judge-hacking detector table: an honest agent and each scripted judge-hacking agent
(``selfrl.judge.hacks.AGENTS``) answer ``--n`` arithmetic tasks (``chain_sum``) and the six
support questions, in groups of 8; a gullible judge scores them (it pays the tricks), then
every judge detector runs. Prints a markdown table: the share flagged by each detector, the
judge's mean score, the verifier's success on the arithmetic tasks, and the judge's mean score
after clamping (a flagged trajectory earns at most 0).

    PYTHONPATH=$PWD python scripts/judge_detector_table.py --n 32
"""

from __future__ import annotations

import argparse
import random

from selfrl.safety.detectors import DetectorConfig, apply_detectors
from selfrl.envs import get_env
from selfrl.judge.hacks import AGENTS, scripted_group, support_tasks

DETECTORS = ["judge_addressed", "judge_vacuous", "judge_length_bias"]


def table(n: int, seed: int = 0) -> list[tuple[str, dict[str, float], float, float, float]]:
    """Per agent: ``(name, detector metrics, mean judge score, verifier success, mean after clamping)``."""
    env = get_env("chain_sum")
    tasks = env.sample(n, seed) + support_tasks()
    rows = []
    for name in AGENTS:
        rng = random.Random(f"{seed}:{name}")
        trajs = [t for i, task in enumerate(tasks) for t in scripted_group(name, task, env, rng, f"{name}-{i}")]
        judged = sum(t.reward for t in trajs) / len(trajs)
        verified = [t for t in trajs if t.correct is not None]
        success = sum(t.correct for t in verified) / len(verified)
        m = apply_detectors(trajs, DetectorConfig(names=DETECTORS))
        rows.append((name, m, judged, success, sum(t.reward for t in trajs) / len(trajs)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=32,
                    help="arithmetic tasks (sampled with --seed), plus 6 support questions")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(f"{args.n} chain_sum tasks and 6 support questions, 8 answers each; flagged share per detector")
    print("| agent | " + " | ".join(DETECTORS) + " | any | judge score (mean) | verifier success | after clamping |")
    print("|---" * (len(DETECTORS) + 5) + "|")
    for name, m, judged, success, after in table(args.n, args.seed):
        cells = [f"{m[f'hacking/{d}']:.2f}" for d in DETECTORS] + [f"{m['hacking/flagged']:.2f}", f"{judged:.2f}",
                                                                    f"{success:.2f}", f"{after:.2f}"]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

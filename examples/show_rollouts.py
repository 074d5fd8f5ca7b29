"""Print a few stored rollouts of a run: the chat, the tool calls, the reward breakdown, the flags.

    python examples/show_rollouts.py runs/guess            # the last 3 training rollouts
    python examples/show_rollouts.py runs/guess -n 8 --iteration 0

Reads the run's store read-only, so it also works while the run is going.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from selfrl.record.store import Store


def show(traj) -> str:
    """One rollout as text: the task and what followed (the worked example left out), then what it
    was paid and why."""
    task = [m for m in traj.messages if m["role"] == "user"][-1:]  # after the worked example, if any
    start = traj.messages.index(task[0]) if task else 0
    lines = [f"--- version {traj.adapter_version}, reward {traj.reward}, correct {traj.correct}, turns {traj.num_turns}"]
    for m in traj.messages[start:]:
        lines.append(f"[{m['role']}] {m['content']}")
    lines.append(f"rewards: {json.dumps(traj.rewards)}")
    if traj.env_state is not None:
        lines.append(f"final state: {json.dumps(traj.env_state)}")
    if traj.flags:
        lines.append(f"flagged: {json.dumps(traj.flags)}")
    if traj.error:
        lines.append(f"error (left out of the update): {traj.error}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description="print a few stored rollouts of a run")
    p.add_argument("run_dir", help="a run folder holding selfrl.db")
    p.add_argument("-n", type=int, default=3, help="how many rollouts, the last ones first (default 3)")
    p.add_argument("--iteration", type=int, help="only this iteration's rollouts")
    a = p.parse_args()
    with Store(Path(a.run_dir) / "selfrl.db", readonly=True) as store:
        trajs = store.trajectories(iteration=a.iteration)
    if not trajs:
        print(f"no rollouts stored in {a.run_dir} yet" + ("" if a.iteration is None else f" for iteration {a.iteration}"))
    for traj in trajs[::-1][:a.n]:
        print(show(traj))


if __name__ == "__main__":
    main()

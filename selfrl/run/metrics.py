"""Where a run's numbers go: the store, ``metrics.jsonl`` and TensorBoard; the numbers of one
iteration (the batch statistics of its rollouts, the update's) and its progress line."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from selfrl.rl.advantages import mean_std
from selfrl.rl.learner import UpdateResult
from selfrl.safety import collapse
from selfrl.safety.collapse import CollapseConfig
from selfrl.record.store import Store
from selfrl.core.trajectory import Trajectory


class MetricsLog:
    """Writes metrics to the store, ``metrics.jsonl`` and TensorBoard (tensorboardX)."""

    def __init__(self, run_dir: Path, store: Store, run_id: int):
        from tensorboardX import SummaryWriter

        self.store, self.run_id = store, run_id
        self.jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)
        self.tb = SummaryWriter(str(run_dir / "tensorboard"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: float(v) for k, v in metrics.items() if v is not None}
        self.store.log_metrics(self.run_id, step, clean)
        self.jsonl.write(json.dumps({"step": step, "time": time.time(), **{
            k: (v if math.isfinite(v) else None) for k, v in clean.items()}}) + "\n")
        for k, v in clean.items():
            if math.isfinite(v):
                self.tb.add_scalar(k, v, step)
        self.tb.flush()

    def close(self) -> None:
        self.jsonl.close()
        self.tb.close()


def rollout_metrics(trajs: list[Trajectory]) -> dict[str, float]:
    """Batch statistics of a set of rollouts (rates in 0..1, tokens per trajectory)."""
    scored = [t for t in trajs if t.reward is not None]
    tool_rates = [t.tool_success_rate for t in trajs if t.tool_success_rate is not None]
    n = max(len(trajs), 1)
    return {
        "reward/mean": mean_std([t.reward for t in scored])[0] if scored else 0.0,
        "train/correct": sum(bool(t.correct) for t in trajs) / n,
        "train/tool_use": sum(t.wrote_a_call for t in trajs) / n,  # written calls count too (max_turns = 1)
        "train/tool_success": sum(tool_rates) / len(tool_rates) if tool_rates else float("nan"),
        "train/truncated": sum(t.truncated for t in trajs) / n,
        "train/completion_tokens": sum(t.num_completion_tokens for t in trajs) / n,
        "train/failed_rollouts": sum(t.error is not None for t in trajs) / n,
        # left out of grouping and the loss (``group_advantages``): no token to train on
        "train/no_trainable_tokens": sum(t.num_completion_tokens == 0 for t in trajs) / n,
    }


def iteration_metrics(result: UpdateResult, candidate_kl: float | None, trajs: list[Trajectory],
                      collapse_cfg: CollapseConfig) -> dict[str, float]:
    """The numbers of one iteration that come from its update and its rollouts: the update's
    (:meth:`UpdateResult.metrics`), the candidate's KL probe (when it ran), :func:`rollout_metrics`,
    and the collapse rules' entropy estimate and degenerate share."""
    metrics = result.metrics()
    if candidate_kl is not None:
        metrics["candidate_kl"] = candidate_kl
    metrics.update(rollout_metrics(trajs))
    metrics.update({"train/entropy": collapse.entropy_estimate(trajs),
                    "train/degenerate": collapse.degenerate_share(trajs, collapse_cfg)})
    return metrics


def iteration_line(it: int, metrics: dict[str, float], result: UpdateResult, version: int, t_roll: float,
                   cause: str | None = None) -> str:
    """The progress line of iteration ``it``: reward, correct, tool use, KL, the ``version`` serving
    after it, seconds in rollouts (``t_roll``) and in the update; why the update was skipped, and
    ``cause`` (why it is not learning), when there is one."""
    note = f" (update skipped: {result.note})" if result.skipped else ""
    if cause:
        note += f" [{cause}]"
    return (f"iteration {it}: reward {metrics['reward/mean']:.3f} correct {metrics['train/correct']:.3f} "
            f"tool use {metrics['train/tool_use']:.2f} kl {metrics.get('kl', 0.0):.4f} "
            f"version {version} (rollouts {t_roll:.0f} s, update {metrics.get('time/update_s', 0.0):.0f} s){note}")

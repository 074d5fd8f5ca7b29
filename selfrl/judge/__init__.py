"""Rewards where no verifier exists: LLM judges (pointwise, or a whole group ranked in one
call), ensembles with rule rewards and a floor, calibration, a verdict cache, token and cost
accounting, and judge-hacking detectors (docs/guides/judge.md).

Importing this package registers the reward function ``judge`` (:data:`selfrl.judge.reward.JUDGE`)
and the detectors ``judge_addressed``, ``judge_vacuous`` and ``judge_length_bias``;
:func:`setup` configures the reward from a ``[judge]`` section. ``selfrl run`` imports it
only when its config names the judge or one of its detectors.
"""

from __future__ import annotations

from pathlib import Path

from selfrl.config.judge import JudgeConfig
from selfrl.judge import detectors  # noqa: F401  registers the judge-hacking detectors
from selfrl.judge.reward import JUDGE, JudgeReward
from selfrl.judge.verdict import JudgeFailure

__all__ = ["JUDGE", "JudgeFailure", "JudgeReward", "setup"]


def setup(cfg: JudgeConfig, run_dir: str | Path | None = None) -> JudgeReward | None:
    """Configure the registered ``judge`` reward from ``cfg`` (see :meth:`JudgeReward.configure`);
    returns it, or None when ``cfg`` has no endpoints (nothing to configure).

    Raises:
        ValueError: a judge's ``api_key_env`` is not set, or the calibration file is bad.
    """
    if not cfg.endpoints:
        return None
    return JUDGE.configure(cfg, run_dir)

"""The reward function ``judge``: one or more LLM judges, combined with rule rewards, capped by
a floor, checked by calibration, with every verdict recorded on its trajectory.

``JUDGE`` is registered as the reward ``judge`` when :mod:`selfrl.judge` is imported, and the
run's setup configures it from ``[judge]`` (:func:`selfrl.judge.setup`). Called on the first
trajectory of a group, it judges the whole group at once (each judge in its own thread,
:class:`selfrl.judge.judge.Judge`) and keeps the outcome in the group's ``RewardContext.cache``;
the other members read it from there.

Failures are never scores: a trajectory without a usable verdict from every judge, a group
whose judge failed calibration, or (``hold_out_disputed``) a group the members disagree on,
raises :class:`selfrl.judge.verdict.JudgeFailure`, which ``score_group`` records on the
trajectory's ``error`` and leaves out of the update. Every judged trajectory gets
``reward_details["judge"]``: each judge's model, rubric version and rubric hash, mode, score,
reason or failure; the rule rewards' values; the combined, capped score.
"""

from __future__ import annotations

import json
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from selfrl.core.atomic import write_atomic
from selfrl.config.judge import JUDGE_REWARD, JudgeConfig
from selfrl.judge.cache import VerdictCache
from selfrl.judge.calibration import CalibrationSource
from selfrl.judge.client import JudgeClient
from selfrl.judge.ensemble import cap, combine, disputed, spread
from selfrl.judge.judge import GroupVerdicts, Judge
from selfrl.judge.verdict import JudgeFailure
from selfrl.envs.rewards import RewardContext, get_reward_func, register_reward_func
from selfrl.core.trajectory import Trajectory

CACHE_FILE = "judge_cache.db"
RUBRICS_FILE = "judge_rubrics.json"


@dataclass
class Outcome:
    """The judge reward's result for one trajectory: a score in [0, 1], or why there is none."""

    score: float | None
    failure: str | None
    details: dict[str, Any] = field(default_factory=dict)


class JudgeReward:
    """The ``judge`` reward function (a callable ``(traj, ctx) -> float``) and its state: the
    judges, the verdict cache, the calibration pairs and the counters of the current iteration."""

    def __init__(self):
        self.cfg: JudgeConfig | None = None
        self.judges: list[Judge] = []
        self.cache: VerdictCache | None = None
        self.calibration: CalibrationSource | None = None
        self.counts: Counter = Counter()

    def configure(self, cfg: JudgeConfig, run_dir: str | Path | None = None,
                  clients: dict[str, JudgeClient] | None = None) -> JudgeReward:
        """Build the judges of ``cfg`` (replacing any earlier ones); with ``run_dir`` the verdict
        cache lives in ``run_dir/judge_cache.db`` and every rubric is written to
        ``run_dir/judge_rubrics.json``. ``clients`` overrides the HTTP client of named judges.

        Raises:
            ValueError: a judge's ``api_key_env`` is not set, or the calibration file is bad.
        """
        self.close()
        run_dir = Path(run_dir) if run_dir is not None else None
        self.cache = VerdictCache(run_dir / CACHE_FILE if run_dir else None) if cfg.cache else None
        self.calibration = CalibrationSource(cfg.calibration, cfg.calibration_pairs)
        self.judges = [Judge(e, (clients or {}).get(e.name), self.cache, cfg.calibration_max_errors)
                       for e in cfg.endpoints]
        self.cfg, self.counts = cfg, Counter()
        if run_dir is not None:
            rubrics = {j.endpoint.name: {"model": j.endpoint.model, "rubric_version": j.endpoint.rubric_version,
                                         "rubric_sha256": j.rubric_sha, "rubric": j.rubric} for j in self.judges}
            run_dir.mkdir(parents=True, exist_ok=True)
            write_atomic(run_dir / RUBRICS_FILE, json.dumps(rubrics, indent=2))
        return self

    def close(self) -> None:
        """Stop the judges' thread pools and close the cache."""
        for j in self.judges:
            j.close()
        if self.cache is not None:
            self.cache.close()
        self.judges, self.cache, self.cfg = [], None, None

    # -- the reward function ----------------------------------------------------------------

    def __call__(self, traj: Trajectory, ctx: RewardContext) -> float:
        """The judged score of ``traj`` in [0, 1].

        Raises:
            RuntimeError: no judge is configured.
            JudgeFailure: no usable score for ``traj`` (the message says why).
        """
        if not self.judges:
            raise RuntimeError(f"the {JUDGE_REWARD!r} reward has no judge: add a [[judge.endpoints]] table "
                               "(docs/guides/judge.md), or call selfrl.judge.setup")
        if JUDGE_REWARD not in ctx.cache:
            ctx.cache[JUDGE_REWARD] = self.judge_group(ctx)
        outcome = ctx.cache[JUDGE_REWARD].get(traj.id)
        if outcome is None:
            raise JudgeFailure(f"trajectory {traj.id} was not in its group when the group was judged")
        traj.reward_details[JUDGE_REWARD] = outcome.details
        if outcome.failure is not None:
            raise JudgeFailure(outcome.failure)
        return outcome.score

    def judge_group(self, ctx: RewardContext) -> dict[str, Outcome]:
        """Every judge on ``ctx.group`` (concurrently), then the rules, the ensemble, disputes and
        the floor; returns ``{trajectory id: Outcome}``."""
        cfg, group = self.cfg, ctx.group
        pairs = self.calibration.pairs(ctx.task, ctx.source)
        with ThreadPoolExecutor(len(self.judges)) as pool:
            verdicts = list(pool.map(lambda j: j.judge_group(ctx.task, group, pairs), self.judges))
        self.count_group(verdicts, len(group))
        outcomes = {t.id: self.outcome(t, ctx, verdicts) for t in group}
        scored = [o for o in outcomes.values() if o.failure is None]
        n_disputed = sum(o.details.get("disputed", False) for o in scored)
        self.counts["disputed"] += n_disputed
        if n_disputed and cfg.hold_out_disputed:
            worst = max(o.details["spread"] for o in scored)
            why = (f"judges disagree on {n_disputed} of {len(group)} trajectories of this group (score spread up to "
                   f"{worst:.2f} > disagreement = {cfg.disagreement:g}); the group is held out")
            for o in scored:
                o.failure = why
            self.counts["held_out_groups"] += 1
        self.counts["scored"] += sum(o.failure is None for o in outcomes.values())
        self.counts["failed"] += sum(o.failure is not None for o in outcomes.values())
        return outcomes

    def outcome(self, traj: Trajectory, ctx: RewardContext, verdicts: list[GroupVerdicts]) -> Outcome:
        """One trajectory's outcome from the judges' ``verdicts`` and the rule rewards."""
        cfg = self.cfg
        judged: dict[str, Any] = {}
        failures = []
        for j, gv in zip(self.judges, verdicts):
            e = j.endpoint
            v, why = gv.verdicts.get(traj.id), gv.failed.get(traj.id)
            judged[e.name] = {"model": e.model, "rubric_version": e.rubric_version, "rubric_sha256": j.rubric_sha,
                              "mode": e.mode, "score": None if v is None else v.score,
                              "reason": None if v is None else v.reason, "failure": why}
            if v is None:
                failures.append(why or f"judge {e.name}: no verdict")
        details: dict[str, Any] = {"judges": judged, "combine": cfg.combine}
        if failures:
            return Outcome(None, "; ".join(failures), details)
        try:
            rules = {r: get_reward_func(r)(traj, ctx) for r in cfg.rules}
            floor = get_reward_func(cfg.floor)(traj, ctx) if cfg.floor else None
        except Exception as err:  # recorded like a failing reward, never a score
            return Outcome(None, f"a rule of the judge failed: {type(err).__name__}: {err}", details)
        members = [s["score"] for s in judged.values()] + [float(v) for v in rules.values() if v is not None]
        combined = combine(members, cfg.combine, cfg.vote_threshold)
        score = cap(combined, None if floor is None else float(floor))
        details.update(rules=rules, floor={cfg.floor: floor} if cfg.floor else {}, combined=combined, score=score,
                       spread=spread(members), disputed=disputed(members, cfg.disagreement))
        return Outcome(score, None, details)

    # -- accounting -------------------------------------------------------------------------

    def count_group(self, verdicts: list[GroupVerdicts], size: int) -> None:
        self.counts["groups"] += 1
        for j, gv in zip(self.judges, verdicts):
            name = j.endpoint.name
            self.counts[f"{name}/cache_hits"] += gv.cached
            self.counts[f"{name}/pairs"] += gv.pairs
            self.counts[f"{name}/right"] += gv.right
            self.counts[f"{name}/held_back_groups"] += gv.held_back is not None
            self.counts[f"{name}/score_sum"] += sum(v.score for v in gv.verdicts.values())
            self.counts[f"{name}/scored"] += len(gv.verdicts)
        self.counts["held_out_groups"] += any(gv.held_back for gv in verdicts)

    def pop_metrics(self) -> dict[str, float]:
        """The metrics since the last call (then zeroed), for one iteration's log:

        ``judge/calls``, ``judge/input_tokens``, ``judge/output_tokens``, ``judge/cache_hits``,
        ``judge/timeouts``, ``judge/failed_calls``; ``judge/cost`` (with a price); trajectories
        ``judge/scored`` and ``judge/failed``, ``judge/disputed``, ``judge/held_out_groups``;
        and per judge ``judge/<name>/{calls,input_tokens,output_tokens,cost,cache_hits,
        score_mean,calibration}`` (``calibration``: the share of known pairs ranked right, only
        when pairs were judged; ``cost`` only with a price).
        """
        out: dict[str, float] = {}
        c, priced = self.counts, False
        totals: Counter = Counter()
        for j in self.judges:
            e, name = j.endpoint, j.endpoint.name
            t = j.client.pop_tally()
            cost = t.input_tokens * e.price_input_per_m / 1e6 + t.output_tokens * e.price_output_per_m / 1e6
            row = {"calls": t.calls, "input_tokens": t.input_tokens, "output_tokens": t.output_tokens,
                   "cache_hits": c[f"{name}/cache_hits"], "timeouts": t.timeouts, "failed_calls": t.failed_calls}
            totals.update(row)
            out.update({f"judge/{name}/{k}": float(v) for k, v in row.items()
                        if k in ("calls", "input_tokens", "output_tokens", "cache_hits")})
            if e.price_input_per_m or e.price_output_per_m:
                priced = True
                totals["cost"] += cost
                out[f"judge/{name}/cost"] = cost
            if c[f"{name}/scored"]:
                out[f"judge/{name}/score_mean"] = c[f"{name}/score_sum"] / c[f"{name}/scored"]
            if c[f"{name}/pairs"]:
                out[f"judge/{name}/calibration"] = c[f"{name}/right"] / c[f"{name}/pairs"]
        out.update({f"judge/{k}": float(totals[k]) for k in
                    ("calls", "input_tokens", "output_tokens", "cache_hits", "timeouts", "failed_calls")})
        if priced:
            out["judge/cost"] = float(totals["cost"])
        out.update({f"judge/{k}": float(c[k]) for k in ("scored", "failed", "disputed", "held_out_groups")})
        self.counts = Counter()
        return out


JUDGE = JudgeReward()
register_reward_func(JUDGE_REWARD, JUDGE)

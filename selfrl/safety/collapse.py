"""Collapse detection: rules over a per-update record, and the safer setting after a rollback.

A *collapse* is a candidate that has gone bad in a way that should not wait for
the next promotion decision: the policy drifts far from its reference, its
entropy falls to nothing (or explodes), it starts looping, stops answering or
runs into the length limit, or it earns more training reward while solving
fewer held-out tasks (the classic sign of reward hacking). Each rule is a pure
function of an :class:`UpdateRecord` history and a :class:`CollapseConfig`
threshold, and returns an :class:`Alarm` (rule, value, threshold) or None.

* Cheap rules (:func:`cheap_alarms`) use only what every iteration measures
  anyway, so they run after every update and roll back at once, between gate checks.
* Held-out rules (:func:`heldout_alarms`) need a validation and run at the gate.
* :class:`CollapseGuard` owns the history, for ``selfrl run`` and ``selfrl serve`` alike
  (``selfrl.run.cycle``); what a collapse costs is :mod:`selfrl.safety.collapse_budget`'s.

Entropy is estimated for free from the stored sampling log-probs: the mean of
``-log p(token)`` over sampled completion tokens is an unbiased Monte-Carlo
estimate of the policy's per-token entropy at the sampling temperature (the
expectation of ``-log p`` under ``p``), no extra forward pass needed.
Baselines are the first ``baseline_window`` records of the run (the starting
policy), so a model that always truncates, say, is not called collapsed for it.

Served traffic drifts (arithmetic first, then function calling joins, whose turns hit the
token limit more often and whose grammar-constrained calls have their own entropy per
token), so in ``selfrl serve`` a turn's family (its request's ``metadata.family``) splits
each update into groups (:func:`family_stats`), and each group is judged against its own
baseline: the first ``baseline_window`` earlier updates with at least ``family_min_turns``
of its turns. A family without a baseline yet is not judged by the entropy and degenerate
rules; its updates build the baseline. Turns without a family are the group :data:`NO_FAMILY`;
a record with no family at all (``selfrl run``, a server whose clients send none) is that
group whole, so without families the rules are the run-wide ones above.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from selfrl.config import CollapseConfig
from selfrl.rl.advantages import mean_std
from selfrl.core.trajectory import Trajectory


NO_FAMILY = "(none)"  # the group of served turns whose request named no family
SMALL_FAMILIES = "(small families)"  # an update's families with fewer than family_min_turns turns, pooled

FAMILY_FIELDS = ("turns", "reward", "entropy", "degenerate")  # logged as family/<name>/<field>


@dataclass(frozen=True)
class FamilyStats:
    """One family's share of an update's batch.

    Attributes:
        turns: the family's trajectories in the batch (count).
        reward: their mean training reward.
        entropy: mean ``-logprob`` per sampled completion token over their tokens (nats), NaN if none.
        degenerate: their share of degenerate rollouts, 0..1.
    """

    turns: int
    reward: float
    entropy: float
    degenerate: float


@dataclass
class UpdateRecord:
    """What one iteration measured, about the version that sampled its rollouts.

    Attributes:
        step: iteration number.
        version: adapter version that sampled the rollouts (and whose KL the update measured).
        reward: mean training reward of the batch.
        entropy: mean ``-logprob`` per sampled completion token (nats), see :func:`entropy_estimate`.
        degenerate: share of degenerate rollouts, 0..1, see :func:`degenerate_share`.
        kl: mean per-token KL to the reference from the update's forward pass (the sampling
            version's weights), None when not measured (``beta == 0`` or no forward pass).
        candidate_kl: the same for the new candidate made by the update, measured on a few of
            the batch's sequences (``Learner.probe_kl``), None when not measured.
        families: the batch split by the turns' family (:func:`family_stats`; turns without one
            under :data:`NO_FAMILY`), None when no turn named a family: then the whole record is
            one group, judged against the run's first records.
    """

    step: int
    version: int
    reward: float
    entropy: float
    degenerate: float
    kl: float | None = None
    candidate_kl: float | None = None
    families: dict[str, FamilyStats] | None = None


@dataclass
class Alarm:
    """A rule that fired: its name, the measured value and the threshold it crossed."""

    rule: str
    value: float
    threshold: float
    message: str

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ------------------------------------------------------------------ measurements


def entropy_estimate(trajs: list[Trajectory]) -> float:
    """Mean ``-logprob`` over all sampled completion tokens of ``trajs`` (nats per token; NaN if none).

    Unbiased for the policy's entropy at the sampling temperature (``logprobs``
    are the sampling distribution's). Greedy rollouts do not qualify.

    >>> t = Trajectory("a", "g", 0, token_ids=[1, 2, 3], completion_mask=[0, 1, 1], logprobs=[0.0, -1.0, -3.0])
    >>> entropy_estimate([t])
    2.0
    """
    total, n = 0.0, 0
    for t in trajs:
        for lp, m in zip(t.logprobs, t.completion_mask):
            if m:
                total, n = total - lp, n + 1
    return total / n if n else math.nan


def repeated_ngram_share(tokens: list[int], n: int) -> float:
    """Share of the ``n``-grams of ``tokens`` that already occurred earlier in it (0 when fewer than 2n tokens).

    >>> repeated_ngram_share([1, 2, 3, 1, 2, 3, 1, 2, 3], 3), repeated_ngram_share(list(range(9)), 3)
    (0.5714285714285714, 0.0)
    """
    if len(tokens) < 2 * n:
        return 0.0
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return (len(grams) - len(set(grams))) / len(grams)


def degenerate_reasons(traj: Trajectory, cfg: CollapseConfig) -> list[str]:
    """Why a rollout is degenerate: ``truncated`` (a turn hit the token limit), ``empty``
    (no final answer text, and it did not end on a tool call), ``loop`` (repeated n-gram share
    above ``cfg.repeat_share``); [] if none.

    A trajectory that ends on the model's tool call (its last message is the assistant's, with
    the call: a served turn the client's tool answers next, or a rollout stopped at the call)
    has given its output as the call, so it is not empty; one that called a tool, got the result
    and then ran out of turns without answering still is."""
    out = []
    if traj.truncated:
        out.append("truncated")
    if not (traj.final_answer or "").strip() and not ends_on_tool_call(traj):
        out.append("empty")
    completion = [tok for tok, m in zip(traj.token_ids, traj.completion_mask) if m]
    if repeated_ngram_share(completion, cfg.repeat_ngram) > cfg.repeat_share:
        out.append("loop")
    return out


def ends_on_tool_call(traj: Trajectory) -> bool:
    """True when the trajectory made a tool call and its last message is the assistant's (no tool
    result after it)."""
    return bool(traj.tool_calls) and bool(traj.messages) and traj.messages[-1].get("role") == "assistant"


def degenerate_share(trajs: list[Trajectory], cfg: CollapseConfig) -> float:
    """Share (0..1) of ``trajs`` with at least one :func:`degenerate_reasons`; NaN for none."""
    return sum(bool(degenerate_reasons(t, cfg)) for t in trajs) / len(trajs) if trajs else math.nan


def family_stats(trajs: list[Trajectory], family_of: dict[str, str | None],
                 cfg: CollapseConfig) -> dict[str, FamilyStats] | None:
    """``trajs`` split by family: ``{family: FamilyStats}`` (turns without one under
    :data:`NO_FAMILY`), or None when no turn has a family (the batch is one group). The groups
    with fewer than ``cfg.family_min_turns`` turns are pooled under :data:`SMALL_FAMILIES`, so
    that a batch spread over many small families is still judged (as one group, against that
    group's own baseline), and a client naming many families adds one group, not one each.

    Args:
        trajs: the update's scored trajectories, (N,).
        family_of: trajectory id -> its request's ``metadata.family`` (None, or missing: no family).

    >>> a = Trajectory("a", "g", 0, token_ids=[1, 2], completion_mask=[0, 1], logprobs=[0.0, -2.0], final_answer="4")
    >>> b = Trajectory("b", "g", 0, token_ids=[1, 2], completion_mask=[0, 1], logprobs=[0.0, -1.0], truncated=True)
    >>> a.reward, b.reward = 1.0, 0.0
    >>> family_stats([a, b], {a.id: "math"}, CollapseConfig(family_min_turns=1))
    {'math': FamilyStats(turns=1, reward=1.0, entropy=2.0, degenerate=0.0), '(none)': FamilyStats(turns=1, reward=0.0, entropy=1.0, degenerate=1.0)}
    >>> family_stats([a, b], {a.id: "math"}, CollapseConfig(family_min_turns=2))
    {'(small families)': FamilyStats(turns=2, reward=0.5, entropy=1.5, degenerate=0.5)}
    >>> family_stats([a, b], {}, CollapseConfig()) is None
    True
    """
    families = [family_of.get(t.id) for t in trajs]
    if all(f is None for f in families):
        return None
    groups: dict[str, list[Trajectory]] = {}
    for t, f in zip(trajs, families):
        groups.setdefault(NO_FAMILY if f is None else f, []).append(t)
    small = [f for f, ts in groups.items() if len(ts) < cfg.family_min_turns]
    if small:
        groups[SMALL_FAMILIES] = [t for f in small for t in groups.pop(f)]
    return {f: FamilyStats(len(ts), sum(t.reward for t in ts) / len(ts), entropy_estimate(ts),
                           degenerate_share(ts, cfg)) for f, ts in groups.items()}


def batch_metrics(trajs: list[Trajectory], family_of: dict[str, str | None], cfg: CollapseConfig) -> dict[str, float]:
    """What the cheap rules read of an update's batch, as metric rows: ``train/entropy`` (nats per
    token), ``train/degenerate`` (0..1) and, where turns name a family, each family's
    (:func:`family_stats`, :func:`family_metrics`). ``family_of`` as in :func:`family_stats`."""
    return family_metrics(family_stats(trajs, family_of, cfg)) | {
        "train/entropy": entropy_estimate(trajs), "train/degenerate": degenerate_share(trajs, cfg)}


def family_metrics(families: dict[str, FamilyStats] | None) -> dict[str, float]:
    """The metric rows of :func:`family_stats`: ``family/<name>/<field>`` for each of
    :data:`FAMILY_FIELDS` ({} for None), read back by :func:`record_from_metrics`."""
    return {f"family/{name}/{k}": float(getattr(st, k)) for name, st in (families or {}).items() for k in FAMILY_FIELDS}


# ------------------------------------------------------------------ history


def record_from_metrics(it: int, metrics: dict[str, float]) -> UpdateRecord:
    """The record of iteration ``it`` from the metrics the loop logs for it: ``sampled_version``,
    ``reward/mean``, ``train/entropy``, ``train/degenerate``, ``kl`` and ``candidate_kl`` (the
    last two may be missing: no forward pass, no candidate; with ``beta == 0`` the update logs
    KL 0, which never fires), and the per-family ``family/<name>/<field>`` of :func:`family_metrics`
    (missing in rows written before families were recorded, or with no family: ``families`` None;
    a family missing one of its fields is left out)."""
    kl = metrics.get("kl")
    fields: dict[str, dict[str, float]] = {}
    for name, value in metrics.items():
        if name.startswith("family/") and name.count("/") >= 2:
            family, field = name[len("family/"):].rsplit("/", 1)
            fields.setdefault(family, {})[field] = value
    families = {f: FamilyStats(int(v["turns"]), v["reward"], v["entropy"], v["degenerate"])
                for f, v in fields.items() if all(k in v for k in FAMILY_FIELDS) and math.isfinite(v["turns"])}
    return UpdateRecord(it, int(metrics["sampled_version"]), metrics["reward/mean"], metrics["train/entropy"],
                        metrics["train/degenerate"], kl, metrics.get("candidate_kl"), families or None)


def history_from_metrics(rows: list[dict]) -> list[UpdateRecord]:
    """The collapse history rebuilt from stored metric rows (for ``--resume``); the
    iterations a killed session left unfinished (no ``reward/mean``) are not in it."""
    by_step: dict[int, dict[str, float]] = {}
    for r in rows:
        by_step.setdefault(r["step"], {})[r["name"]] = math.nan if r["value"] is None else r["value"]
    out = []
    for step in sorted(by_step):
        m = by_step[step]
        if all(k in m for k in ("reward/mean", "sampled_version", "train/entropy", "train/degenerate")):
            out.append(record_from_metrics(step, m))
    return out


# ------------------------------------------------------------------------- rules


def groups(rec: UpdateRecord, min_turns: int) -> dict[str, tuple[FamilyStats, bool]]:
    """The groups ``rec`` is judged in: ``{family: (stats, enough turns)}``.

    A record without families is one group, :data:`NO_FAMILY`, holding its run-wide values,
    and always has enough turns (so ``selfrl run`` is judged exactly as before families);
    with families, a group has enough with at least ``min_turns`` turns.
    """
    if rec.families is None:
        return {NO_FAMILY: (FamilyStats(0, rec.reward, rec.entropy, rec.degenerate), True)}
    return {f: (st, st.turns >= min_turns) for f, st in rec.families.items()}


def family_baseline(history: list[UpdateRecord], family: str, cfg: CollapseConfig) -> list[FamilyStats] | None:
    """The baseline records of ``family`` for judging ``history[-1]``: its stats in the first
    ``cfg.baseline_window`` earlier records where it had ``cfg.family_min_turns`` turns
    (:func:`groups`), or None while fewer exist (the family is still building its baseline)."""
    base = []
    for rec in history[:-1]:
        st, enough = groups(rec, cfg.family_min_turns).get(family, (None, False))
        if enough:
            base.append(st)
            if len(base) == cfg.baseline_window:
                return base
    return None


def _mean(stats: list[FamilyStats], field: str) -> float:
    """Mean of ``field`` over ``stats``, skipping values that are not finite (NaN if none is)."""
    vals = [getattr(st, field) for st in stats if math.isfinite(getattr(st, field))]
    return mean_std(vals)[0] if vals else math.nan


def _judged(history: list[UpdateRecord], cfg: CollapseConfig) -> list[tuple[str, FamilyStats, list[FamilyStats]]]:
    """``(family, its stats in history[-1], its baseline)`` for each group of the last record
    that has enough turns and a baseline (see :func:`family_baseline`)."""
    out = []
    for family, (st, enough) in groups(history[-1], cfg.family_min_turns).items():
        base = family_baseline(history, family, cfg) if enough else None
        if base is not None:
            out.append((family, st, base))
    return out


def _named(rec: UpdateRecord, family: str) -> str:
    """`` (family f)`` appended to an alarm message of a record with families; nothing without."""
    if rec.families is None:
        return ""
    return " (turns without a family)" if family == NO_FAMILY else f" (family {family})"


def kl_rule(rec: UpdateRecord, cfg: CollapseConfig) -> Alarm | None:
    """``kl``: the KL to the reference of the sampling version (measured in the update) or of
    the new candidate (measured after it) exceeds ``cfg.max_kl``, or is not finite."""
    for name, kl in (("new candidate", rec.candidate_kl), ("sampling version", rec.kl)):
        if kl is not None and not (math.isfinite(kl) and kl <= cfg.max_kl):
            return Alarm("kl", kl, cfg.max_kl, f"KL to the reference of the {name} {kl:.4g} > {cfg.max_kl:g}")
    return None


def entropy_rule(history: list[UpdateRecord], cfg: CollapseConfig) -> list[Alarm]:
    """``entropy_collapse`` / ``entropy_blowup``: a group's entropy (nats/token) in the last record
    below both ``entropy_min_ratio`` times its baseline and the baseline minus ``entropy_min_drop``,
    or above both ``entropy_max_ratio`` times it and the baseline plus ``entropy_max_rise``; one
    alarm per group that fires (silent for a group without a baseline yet, see :func:`family_baseline`).

    The absolute margins are for the near-0 baselines of grammar-constrained turns, where the
    grammar leaves one token at most steps: in a 90-minute soak the web family's baseline was
    0.019 nats/token and ordinary updates measured 0.10 and 0.16 (5-8 times it), three false
    rollbacks under the ratio alone; weights turned to noise give several nats/token. Downwards
    the same: in three 90-minute soaks the web family's entropy went from update to update
    anywhere between 0.01 and 0.20 nats/token while its held-out success stayed put or rose, and
    under the ratio alone three ordinary updates of one run (0.020, 0.012 and 0.018 against a
    baseline of 0.129) were rolled back as collapses. A family whose baseline is below ``entropy_min_drop``
    is then never judged by its entropy falling; the KL rule and the held-out gate still are.

    A policy that learns becomes confident, so low entropy alone is not a collapse: on
    ``make demo`` the entropy fell from 0.36 to 0.075 nats/token while held-out success went
    from 7 % to 100 %. ``entropy_collapse`` therefore fires only while the group's training
    reward has not risen by ``entropy_reward_gain`` over its baseline (a policy that stops
    exploring without getting better)."""
    rec, out = history[-1], []
    for family, st, base_stats in _judged(history, cfg):
        base = _mean(base_stats, "entropy")
        if not (math.isfinite(base) and base > 0) or math.isnan(st.entropy):  # NaN: no completion token sampled
            continue
        lo = min(cfg.entropy_min_ratio * base, base - cfg.entropy_min_drop)
        hi = max(cfg.entropy_max_ratio * base, base + cfg.entropy_max_rise)
        reward_base = _mean(base_stats, "reward")
        learning = math.isfinite(reward_base) and st.reward >= reward_base + cfg.entropy_reward_gain
        if st.entropy < lo and not learning:
            out.append(Alarm("entropy_collapse", st.entropy, lo, f"entropy {st.entropy:.3f} nats/token < {lo:.3f} "
                             f"({cfg.entropy_min_ratio:g} x baseline {base:.3f}, at least -{cfg.entropy_min_drop:g})"
                             f"{_named(rec, family)}"))
        elif st.entropy > hi:
            out.append(Alarm("entropy_blowup", st.entropy, hi, f"entropy {st.entropy:.3f} nats/token > {hi:.3f} "
                             f"({cfg.entropy_max_ratio:g} x baseline {base:.3f}, at least +{cfg.entropy_max_rise:g})"
                             f"{_named(rec, family)}"))
    return out


def degenerate_rule(history: list[UpdateRecord], cfg: CollapseConfig) -> list[Alarm]:
    """``degenerate``: a group's degenerate share (0..1) in the last record exceeds its baseline
    share plus ``cfg.degenerate_rise``; one alarm per group that fires (silent for a group
    without a baseline yet, see :func:`family_baseline`)."""
    rec, out = history[-1], []
    for family, st, base_stats in _judged(history, cfg):
        base = _mean(base_stats, "degenerate")
        if not math.isfinite(base) or not math.isfinite(st.degenerate):
            continue
        limit = base + cfg.degenerate_rise
        if st.degenerate > limit:
            out.append(Alarm("degenerate", st.degenerate, limit, f"degenerate rollouts {st.degenerate:.2f} > "
                             f"baseline {base:.2f} + {cfg.degenerate_rise:g}{_named(rec, family)}"))
    return out


def cheap_alarms(history: list[UpdateRecord], cfg: CollapseConfig) -> list[Alarm]:
    """Every cheap rule that fires on the last record of ``history`` (run after each update)."""
    if not cfg.enabled or not history:
        return []
    kl = kl_rule(history[-1], cfg)
    return ([kl] if kl else []) + entropy_rule(history, cfg) + degenerate_rule(history, cfg)


def heldout_alarms(success: float, best_success: float, candidate_rewards: list[float], best_rewards: list[float],
                   tolerance: float, cfg: CollapseConfig) -> list[Alarm]:
    """Held-out rules, run when a candidate has been validated.

    Args:
        success: the candidate's held-out success (0..1).
        best_success: the best version's held-out success.
        candidate_rewards: mean training rewards of the iterations since the best
            version last served (the candidate's chain).
        best_rewards: mean training rewards of iterations sampled by the best version.
        tolerance: the gate's tolerance; ``reward_vs_heldout`` needs held-out below best minus it.

    Rules: ``heldout_drop`` (success < best - ``cfg.heldout_drop``) and
    ``reward_vs_heldout`` (mean candidate reward >= mean best reward + ``cfg.reward_rise``
    while success < best - tolerance).
    """
    if not cfg.enabled:
        return []
    out = []
    if success < best_success - cfg.heldout_drop:
        out.append(Alarm("heldout_drop", success, best_success - cfg.heldout_drop,
                         f"held-out success {success:.3f} < best {best_success:.3f} - {cfg.heldout_drop:g}"))
    candidate_rewards = [r for r in candidate_rewards if math.isfinite(r)]  # a resumed run's records may hold inf
    best_rewards = [r for r in best_rewards if math.isfinite(r)]
    if candidate_rewards and best_rewards and success < best_success - tolerance:
        rise = mean_std(candidate_rewards)[0] - mean_std(best_rewards)[0]  # inf only past 1.8e308
        if rise >= cfg.reward_rise:
            out.append(Alarm("reward_vs_heldout", rise, cfg.reward_rise,
                             f"training reward up {rise:+.3f} while held-out fell to {success:.3f} "
                             f"(best {best_success:.3f})"))
    return out


def validation_alarm(degenerate: float, base_degenerate: float, cfg: CollapseConfig) -> Alarm | None:
    """``degenerate`` at validation: the candidate's share of degenerate greedy held-out
    rollouts exceeds the base version's share plus ``cfg.degenerate_rise``."""
    if not cfg.enabled or not (math.isfinite(degenerate) and math.isfinite(base_degenerate)):
        return None
    limit = base_degenerate + cfg.degenerate_rise
    if degenerate > limit:
        return Alarm("degenerate", degenerate, limit, f"degenerate held-out rollouts {degenerate:.2f} > base "
                     f"{base_degenerate:.2f} + {cfg.degenerate_rise:g}")
    return None


def safer_setting(learning_rate: float, beta: float, cfg: CollapseConfig) -> tuple[float, float]:
    """The ``(learning_rate, beta)`` to continue with after a collapse rollback.

    >>> safer_setting(1e-4, 0.0, CollapseConfig())
    (5e-05, 0.01)
    >>> safer_setting(1e-4, 0.02, CollapseConfig())
    (5e-05, 0.04)
    """
    return learning_rate * cfg.lr_factor, max(beta * cfg.beta_factor, cfg.beta_min)


# ------------------------------------------------------------------------- guard


class CollapseStop(Exception):
    """``collapse.max_rollbacks`` is set and spent; the run stops with the best version served."""


class CollapseGuard:
    """Owns the collapse history.

    One record per update (:meth:`observe`, which runs the cheap rules); the held-out
    rules at the gate (:meth:`heldout`). A *chain* is the run of updates since the champion
    last served (reset by :meth:`new_chain`). What a collapse costs (the backoff, the pause,
    a stop on request) is :class:`selfrl.safety.collapse_budget.CollapseBudget`'s.
    """

    def __init__(self, cfg: CollapseConfig, history: list[UpdateRecord] | None = None):
        self.cfg = cfg
        self.history: list[UpdateRecord] = list(history or [])
        self.chain_start = len(self.history)

    def observe(self, rec: UpdateRecord) -> list[Alarm]:
        """Add one update's record; the cheap rules that fire on it."""
        self.history.append(rec)
        return cheap_alarms(self.history, self.cfg)

    def heldout(self, success: float, best_success: float, best_version: int, tolerance: float,
                degenerate: float, base_degenerate: float | None) -> list[Alarm]:
        """Held-out rules for a validated candidate (see :func:`heldout_alarms`, :func:`validation_alarm`)."""
        chain = self.history[self.chain_start:]
        alarms = heldout_alarms(success, best_success, [r.reward for r in chain if r.version != best_version],
                                [r.reward for r in self.history if r.version == best_version], tolerance, self.cfg)
        bad = validation_alarm(degenerate, math.nan if base_degenerate is None else base_degenerate, self.cfg)
        return alarms + ([bad] if bad else [])

    def new_chain(self) -> None:
        self.chain_start = len(self.history)

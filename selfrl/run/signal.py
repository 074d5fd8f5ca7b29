"""Where the learning signal is: per-task pass-rate estimates, signal-aware task choice,
and the diagnosis of a run that is not learning.

GRPO learns only from groups whose rewards differ: a group whose samples all fail
(or all succeed) has advantage 0 everywhere and costs its rollouts for nothing
(TRL logs the share as ``frac_reward_zero_std``). This module

* estimates each task's pass rate online from its earlier groups
  (``PassRates``: a Beta posterior whose prior is the run's overall pass rate);
* chooses the tasks of an iteration (``SignalChooser``): it walks the same
  shuffled order as the plain cycle, but skips a task whose predicted chance of a
  group with spread (beta-binomial: ``1 - P(all G fail) - P(all G pass)`` under
  the task's posterior; ``1 - p^G - (1 - p)^G`` for a known pass rate ``p``) is
  below ``min_spread``; a skipped task is tried again after ``retry_after``
  iterations, since the policy changes;
* names why a batch gives nothing to learn (``diagnose``), for the pre-flight
  check before the first update and for the iteration line of every skipped or
  flat update, with what to change.

Departure from the literature: curricula such as DAPO's dynamic sampling
over-sample and *filter* constant groups after generating them; this predicts
them and does not generate them.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from selfrl.core.tasks import Task
from selfrl.core.trajectory import Trajectory

__all__ = ["PassRates", "ProbeReport", "SignalChooser", "diagnose", "probe_report", "spread_probability"]


def spread_probability(p: float, group_size: int) -> float:
    """Chance that a group of ``group_size`` independent samples with pass rate ``p`` is not constant.

    >>> spread_probability(0.5, 8) == 1 - 2 * 0.5 ** 8
    True
    >>> spread_probability(0.0, 8), spread_probability(1.0, 8)
    (0.0, 0.0)
    """
    return max(0.0, 1.0 - p ** group_size - (1.0 - p) ** group_size)


@dataclass
class PassRates:
    """Per-task pass-rate estimates from the groups seen so far.

    A sample passes when ``traj.correct`` (the verifier's verdict) holds. The
    estimate of task ``t`` is the posterior mean of a Beta prior with mean equal
    to the run's overall pass rate and weight ``prior_strength`` samples.
    """

    prior_strength: float = 2.0
    passed: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    seen: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def observe(self, trajs: list[Trajectory]) -> None:
        """Add scored trajectories (those with ``correct`` set; failed rollouts are left out)."""
        for t in trajs:
            if t.correct is not None and t.error is None:
                self.seen[t.task_id] += 1
                self.passed[t.task_id] += bool(t.correct)

    def overall(self) -> float:
        n = sum(self.seen.values())
        return sum(self.passed.values()) / n if n else 0.5

    def posterior(self, task_id: str) -> tuple[float, float]:
        """``(alpha, beta)`` of the task's Beta posterior."""
        m, k = self.overall(), self.prior_strength
        n, s = self.seen.get(task_id, 0), self.passed.get(task_id, 0)
        return s + k * m, (n - s) + k * (1.0 - m)

    def spread_chance(self, task_id: str, group_size: int) -> float:
        """Beta-binomial chance that ``group_size`` new samples are neither all failed nor all passed.

        >>> r = PassRates()
        >>> r.observe([Trajectory("a", "g", 0, correct=False)] * 8 + [Trajectory("b", "g", 0, correct=True)] * 2)
        >>> round(r.spread_chance("a", 8), 3), round(r.spread_chance("unseen", 8), 3)
        (0.22, 0.527)
        """
        a, b = self.posterior(task_id)
        fail = passed = 1.0
        for i in range(group_size):
            fail *= (b + i) / (a + b + i)
            passed *= (a + i) / (a + b + i)
        return max(0.0, 1.0 - fail - passed)

    def estimate(self, task_id: str) -> float:
        """Posterior mean pass rate of ``task_id`` (the overall rate for a task never seen)."""
        m, k = self.overall(), self.prior_strength
        return (self.passed.get(task_id, 0) + k * m) / (self.seen.get(task_id, 0) + k)


@dataclass
class SignalChooser:
    """Signal-aware task choice; see the module docstring.

    Attributes:
        min_spread: skip a task seen before whose predicted chance of a group with
            reward spread is below this.
        retry_after: iterations after which a skipped task may be tried again.
    """

    group_size: int
    min_spread: float = 0.4
    retry_after: int = 4
    rates: PassRates = field(default_factory=PassRates)
    skipped_at: dict[str, int] = field(default_factory=dict)
    cursor: int = 0
    last_skipped: int = 0

    def predicted_spread(self, task_id: str) -> float:
        """Posterior predictive chance that the next group of ``group_size`` is not constant:
        ``1 - P(all fail) - P(all pass)`` under the task's Beta posterior (beta-binomial)."""
        return self.rates.spread_chance(task_id, self.group_size)

    def choose(self, order: list[Task], iteration: int, n: int) -> list[Task]:
        """``n`` tasks for ``iteration``, walking ``order`` (the plain cycle's order) from where the
        last call stopped and skipping tasks predicted to give constant groups. When a whole
        pass over ``order`` finds fewer than ``n``, the best predicted of the skipped fill the rest.
        """
        chosen: list[Task] = []
        passed_over: list[Task] = []
        skipped = 0
        for _ in range(len(order)):
            if len(chosen) == n:
                break
            task = order[self.cursor % len(order)]
            self.cursor += 1
            seen = self.rates.seen.get(task.id, 0) > 0
            recent = iteration - self.skipped_at.get(task.id, -10**9) < self.retry_after
            if seen and (self.predicted_spread(task.id) < self.min_spread or recent):
                if not recent:
                    self.skipped_at[task.id] = iteration
                passed_over.append(task)
                skipped += 1
                continue
            chosen.append(task)
        if len(chosen) < n:
            passed_over.sort(key=lambda t: -self.predicted_spread(t.id))
            chosen += passed_over[: n - len(chosen)]
        while len(chosen) < n:  # fewer distinct tasks than n: repeat, as the plain cycle does
            chosen.append(order[self.cursor % len(order)])
            self.cursor += 1
        self.last_skipped = skipped
        return chosen

    def observe(self, trajs: list[Trajectory]) -> None:
        self.rates.observe(trajs)


@dataclass
class ProbeReport:
    """What a batch of groups says about the learning signal.

    Attributes:
        groups: groups in the batch; samples: scored samples.
        pass_at_1: share of samples the verifier passed.
        pass_at_k: share of groups with at least one passed sample (k = group size).
        tool_use: share of samples that called a tool (or wrote a call on their last turn).
        zero_signal: share of groups whose rewards are all equal (no gradient).
        all_fail, all_pass: share of groups where every sample failed / passed.
        first_error: the first failed trajectory's ``error`` (None when none failed).
    """

    groups: int
    samples: int
    pass_at_1: float
    pass_at_k: float
    tool_use: float
    zero_signal: float
    all_fail: float
    all_pass: float
    first_error: str | None = None

    def line(self) -> str:
        return (f"pass@1 {self.pass_at_1:.2f}, pass@k {self.pass_at_k:.2f}, tool use {self.tool_use:.2f}, "
                f"zero-signal groups {self.zero_signal:.0%} ({self.groups} groups)")


def probe_report(trajs: list[Trajectory]) -> ProbeReport:
    """Statistics of scored trajectories grouped by ``group_id`` (rewards and ``correct`` set).

    >>> T = lambda g, r, c: Trajectory("t" + g, g, 0, reward=r, correct=c)
    >>> r = probe_report([T("a", 1.0, True), T("a", 0.0, False), T("b", 0.0, False), T("b", 0.0, False)])
    >>> r.pass_at_1, r.pass_at_k, r.zero_signal, r.all_fail
    (0.25, 0.5, 0.5, 0.5)
    """
    groups: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajs:
        if t.reward is not None:
            groups[t.group_id].append(t)
    samples = [t for g in groups.values() for t in g]
    n, g = max(len(samples), 1), max(len(groups), 1)
    constant = [grp for grp in groups.values() if len(grp) < 2 or max(t.reward for t in grp) - min(t.reward for t in grp) < 1e-9]
    return ProbeReport(
        groups=len(groups), samples=len(samples),
        pass_at_1=sum(bool(t.correct) for t in samples) / n,
        pass_at_k=sum(any(t.correct for t in grp) for grp in groups.values()) / g,
        tool_use=sum(t.wrote_a_call for t in samples) / n,
        zero_signal=len(constant) / g if groups else 1.0,
        all_fail=sum(not any(t.correct for t in grp) for grp in groups.values()) / g,
        all_pass=sum(all(t.correct for t in grp) for grp in groups.values()) / g,
        first_error=next((t.error for t in trajs if t.error), None),
    )


def diagnose(report: ProbeReport, temperature: float, group_size: int, tools: bool,
             demonstration: bool = False, tools_prompt: str | None = None, constrain: str = "none") -> str | None:
    """Why this batch gives (almost) nothing to learn, with what to change; None when it has signal.

    ``tools``: the environment offers tools (then low tool use is named);
    ``demonstration``: a worked example is already shown (then more examples are suggested);
    ``tools_prompt``, ``constrain``: the rollout's settings, so that only a change that is
    not already made is suggested (a compact tool description, grammar-constrained calls).

    >>> diagnose(ProbeReport(8, 64, 0.0, 0.0, 0.02, 1.0, 1.0, 0.0), 0.7, 8, True)[:40]
    'no signal: every group failed every samp'
    """
    if report.groups == 0:
        first = f": the first: {report.first_error[:300]}" if report.first_error else ""
        return f"no signal: no scored group (every rollout failed{first})"
    if report.zero_signal < 0.75:
        return None
    hints = []
    if report.all_fail >= 0.5 and constrain != "none":
        hints.append(f"every turn is forced to be a call (rollout.constrain = {constrain!r}): an environment "
                     "answered in text can never answer; set constrain = \"none\" unless the calls are the answer")
    if report.all_fail >= 0.5:
        if tools and report.tool_use < 0.2:
            fixes = ["show " + ("more worked examples (an environment's k-shot option)" if demonstration
                                else "a worked tool call (rollout.demonstration = true)")]
            if tools_prompt != "compact":
                fixes.append("a compact tool description (rollout.tools_prompt = \"compact\")")
            if constrain == "none":
                fixes.append("where every turn should be a call, decode it under a grammar "
                             "(rollout.constrain = \"tool_call\")")
            hints.append(f"tool use is {report.tool_use:.0%}: " + ", or ".join(fixes))
        hints.append("choose an easier subset ([task] options) or a partial-credit preset")
        if temperature < 1.0:
            hints.append(f"raise rollout.temperature (now {temperature:g})")
        hints.append(f"raise num_generations (now {group_size}) so that a rare success lands in a group")
        what = "every group failed every sample" if report.all_fail == 1.0 else f"{report.all_fail:.0%} of groups failed every sample"
    elif report.all_pass >= 0.5:
        hints.append("the tasks are too easy for this policy: choose harder ones, or stop: a prompt already solves them")
        what = f"{report.all_pass:.0%} of groups passed every sample"
    else:
        what = "the rewards within groups are equal"
        hints.append("the reward does not separate samples: check the preset's components")
    head = "no signal" if report.zero_signal == 1.0 else f"little signal ({report.zero_signal:.0%} of groups constant)"
    return f"{head}: {what}; try: " + "; ".join(hints)

"""No forgetting: one rule for every gate that guards several families of tasks.

A *family* is a set of held-out tasks with its own tolerance: an agent of ``selfrl run``
(``[[agents]]``) or a family of ``selfrl serve``'s traffic (``[[families]]``). A candidate
adapter passes when, on every gated family, its held-out success is at least the
reference's minus that family's tolerance::

    candidate_success(f) >= reference_success(f) - tolerance(f)       for every gated f

(:func:`selfrl.record.versions.passes_gate`, per family). The reference of a family is the
best held-out result any promoted version (or the base) had on that family's tasks
(:func:`best_per_family`): the same ratchet as the aggregate gate, whose best never falls,
so a run cannot lose a family by a tolerance at a time. Each family is compared on the
same tasks, so besides the two success rates and their Wilson intervals (Wilson 1927) the
verdict gives the paired difference ``candidate - reference`` with its 95 % normal interval
(:func:`selfrl.core.stats.paired_difference_ci`) and the tasks lost: solved by the
reference, failed by the candidate.

The decision itself is the point estimate against the tolerance, as the aggregate gate's;
the intervals say how sure the drop is, they do not decide it (a family of 8 tasks has
intervals about 0.6 wide). Families that were never learned are not gated (``gated``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from selfrl.core.stats import paired_difference_ci, wilson_interval

Results = Mapping[str, bool]  # {held-out task id: solved}


@dataclass(frozen=True)
class FamilyComparison:
    """One family, candidate against reference, on the same held-out tasks.

    Attributes:
        family: the family's (or agent's) name.
        reference_success / candidate_success: held-out success (0..1).
        drop: ``reference_success - candidate_success`` (negative: the candidate gained).
        tolerance: the largest drop the family accepts (>= 0).
        reference_interval / candidate_interval: 95 % Wilson intervals of the two rates.
        paired_difference: ``candidate - reference``, mean over the tasks (= ``-drop``).
        paired_interval: its 95 % normal interval on the per-task differences.
        lost_tasks: task ids the reference solved and the candidate failed (sorted).
        tasks: number of held-out tasks compared.
        reference_version: the version whose results are the reference (None: not known).
    """

    family: str
    reference_success: float
    candidate_success: float
    drop: float
    tolerance: float
    reference_interval: tuple[float, float]
    candidate_interval: tuple[float, float]
    paired_difference: float
    paired_interval: tuple[float, float]
    lost_tasks: list[str] = field(default_factory=list)
    tasks: int = 0
    reference_version: int | None = None

    @property
    def dropped(self) -> bool:
        """The candidate fell by more than the tolerance (``not passes_gate`` for this family)."""
        return self.candidate_success < self.reference_success - self.tolerance

    def message(self, noun: str = "family") -> str:
        """One line: the family, the two rates, the drop, the lost tasks, then the intervals."""
        lo, hi = self.paired_interval
        (rl, rh), (cl, ch) = self.reference_interval, self.candidate_interval
        ref = "" if self.reference_version is None else f" of version {self.reference_version}"
        return (f"{noun} {self.family}: held-out {self.candidate_success:.3f} < {self.reference_success:.3f}{ref} "
                f"- {self.tolerance:g} (down {self.drop:.3f}); lost tasks {', '.join(self.lost_tasks) or 'none'}; "
                f"paired difference {self.paired_difference:+.3f} (95% CI {lo:+.3f} to {hi:+.3f}) on {self.tasks} "
                f"tasks; Wilson 95% {rl:.3f}-{rh:.3f} -> {cl:.3f}-{ch:.3f}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (intervals as two-element lists), for an event's data."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


@dataclass(frozen=True)
class FamiliesVerdict:
    """The rule's decision over the gated families.

    Attributes:
        passed: no gated family dropped beyond its tolerance.
        compared: every gated family's comparison, by name (sorted).
        dropped: the families that block the promotion (empty when passed).
        not_gated: families with results that were not gated (never learned), sorted.
    """

    passed: bool
    compared: dict[str, FamilyComparison]
    dropped: list[FamilyComparison]
    not_gated: list[str] = field(default_factory=list)

    @property
    def success(self) -> dict[str, tuple[float, float]]:
        """``{family: (reference, candidate)}`` held-out success of the gated families."""
        return {f: (c.reference_success, c.candidate_success) for f, c in self.compared.items()}

    def message(self, noun: str = "family") -> str:
        """The dropped families' lines joined by ``"; "`` (empty when passed): a gate's veto."""
        return "; ".join(c.message(noun) for c in self.dropped)

    def report(self, noun: str = "family") -> str:
        """One line per gated family with its two rates, then each drop in full."""
        head = "passed" if self.passed else f"rejected: {len(self.dropped)} {noun}(s) dropped beyond tolerance"
        lines = [head] + [f"  {f}: {c.reference_success:.3f} -> {c.candidate_success:.3f}"
                          for f, c in self.compared.items()]
        lines += [f"  not gated (never learned): {', '.join(self.not_gated)}"] if self.not_gated else []
        return "\n".join(lines + [f"  dropped: {c.message(noun)}" for c in self.dropped])


def compare_family(family: str, reference: Results, candidate: Results, tolerance: float,
                   reference_version: int | None = None, z: float = 1.96) -> FamilyComparison:
    """Candidate against reference on one family's held-out tasks (see the module docstring).

    Raises:
        ValueError: the two were evaluated on different (or no) tasks, or ``tolerance`` is not in [0, 1].
    """
    if set(reference) != set(candidate) or not reference:
        raise ValueError(f"{family}: reference and candidate were evaluated on different (or no) tasks")
    if not 0 <= tolerance <= 1:
        raise ValueError(f"{family}: tolerance must be in [0, 1], got {tolerance}")
    tasks = sorted(reference)
    before, after = [bool(reference[t]) for t in tasks], [bool(candidate[t]) for t in tasks]
    n, k_ref, k_cand = len(tasks), sum(before), sum(after)
    diff, lo, hi = paired_difference_ci(before, after, z)
    return FamilyComparison(
        family, k_ref / n, k_cand / n, (k_ref - k_cand) / n, tolerance, wilson_interval(k_ref, n, z),
        wilson_interval(k_cand, n, z), diff, (lo, hi), [t for t, b, a in zip(tasks, before, after) if b and not a],
        n, reference_version)


def judge_families(reference: Mapping[str, Results], candidate: Mapping[str, Results],
                   tolerance: Mapping[str, float], gated: Iterable[str] | None = None,
                   reference_version: Mapping[str, int] | None = None) -> FamiliesVerdict:
    """The no-forgetting rule: pass, or the families the candidate dropped beyond tolerance.

    Args:
        reference: ``{family: {task id: solved}}`` of the reference (the champion, or the best
            per family: :func:`best_per_family`).
        candidate: the candidate's, on the same tasks per family.
        tolerance: ``{family: largest allowed drop}`` (0..1), for every gated family.
        gated: the families to gate (``selfrl serve``: those it has learned); None: every
            family of ``candidate``. A gated family without results is an error; one with
            results that is not gated is listed in ``not_gated``.
        reference_version: ``{family: version}`` the reference results come from (for messages).

    Returns:
        the verdict; families in sorted order.

    Raises:
        ValueError: a gated family has no reference, candidate or tolerance, or its two task
            sets differ, or a tolerance is outside [0, 1].

    >>> v = judge_families({"a": {"x": True, "y": True}, "b": {"z": True}},
    ...                    {"a": {"x": True, "y": False}, "b": {"z": True}}, {"a": 0.1, "b": 0.1})
    >>> v.passed, [(c.family, c.drop, c.lost_tasks) for c in v.dropped]
    (False, [('a', 0.5, ['y'])])
    """
    names = sorted(candidate if gated is None else set(gated))
    missing = [f for f in names if f not in reference or f not in candidate or f not in tolerance]
    if missing:
        raise ValueError(f"no held-out results or tolerance for {', '.join(missing)}: reference has "
                         f"{sorted(reference)}, candidate {sorted(candidate)}, tolerance {sorted(tolerance)}")
    versions = reference_version or {}
    compared = {f: compare_family(f, reference[f], candidate[f], tolerance[f], versions.get(f)) for f in names}
    dropped = [c for c in compared.values() if c.dropped]
    return FamiliesVerdict(not dropped, compared, dropped, sorted(set(candidate) - set(names)))


def best_per_family(references: Mapping[int, Mapping[str, Results]],
                    candidate: Mapping[str, Results]) -> tuple[dict[str, dict[str, bool]], dict[str, int]]:
    """Per family, the best reference result on the candidate's tasks of that family.

    Args:
        references: ``{version: {family: {task id: solved}}}`` of the versions that may serve
            as reference (the base and the promoted ones; the champion among them).
        candidate: ``{family: {task id: solved}}``: which tasks each family is judged on.

    Returns:
        ``(results, versions)``: ``{family: {task id: solved}}`` restricted to the candidate's
        tasks, and ``{family: version}`` it came from. A version counts for a family only if it
        was evaluated on all of the family's tasks; the highest success wins, ties going to
        the newest version. A family no version covers is left out (the caller validates a
        reference on it first).

    >>> best_per_family({0: {"a": {"x": True, "y": False}}, 3: {"a": {"x": False, "y": False}}},
    ...                 {"a": {"x": False, "y": True}})
    ({'a': {'x': True, 'y': False}}, {'a': 0})
    """
    results: dict[str, dict[str, bool]] = {}
    versions: dict[str, int] = {}
    for family, tasks in candidate.items():
        best: tuple[int, int] | None = None  # (solved, version)
        for version, fams in references.items():
            have = fams.get(family, {})
            if not set(tasks) <= set(have):
                continue
            score = (sum(bool(have[t]) for t in tasks), version)
            if best is None or score > best:
                best = score
        if best is not None:
            versions[family] = best[1]
            results[family] = {t: bool(references[best[1]][family][t]) for t in tasks}
    return results, versions

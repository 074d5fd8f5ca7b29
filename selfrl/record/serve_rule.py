"""Which version a run serves when it ends, and the line that says why (``gate.rule``).

The gate promotes a candidate whose held-out success is within ``gate.tolerance`` of the
best so far (:func:`selfrl.record.versions.passes_gate`), so the newest promoted version may
score a little below an earlier one. ``gate.rule`` says which of the two the run serves at its
end: ``newest`` (the default; docs/concepts/versions-gate-rollback.md argues why) or ``best``.
:func:`choose_served` picks, and :meth:`ServedChoice.line` says which, its score, the best
one and the rule, for the end of ``selfrl run`` and its report.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from selfrl.record.versions import Ledger, VersionRecord

__all__ = ["ServeRule", "ServedChoice", "choose_served", "serve_by_rule"]


class ServeRule(str, enum.Enum):
    """Which version a run serves when it ends (``gate.rule``; :func:`choose_served`)."""

    NEWEST = "newest"  # the newest promoted version: each was within ``tolerance`` of the best when promoted
    BEST = "best"  # the version with the highest held-out success (the newer on a tie)


@dataclass(frozen=True)
class ServedChoice:
    """The version served at the end of a run, and the two it is chosen between.

    Attributes:
        rule: the rule that chose ``served`` (``gate.rule``).
        tolerance: ``gate.tolerance``, how far below the best a promotion may be.
        served: the version served.
        newest, best: the newest base or promoted version, and the one with the highest
            held-out success (the newer on a tie).
        success: version -> its own held-out success (0..1; None when never validated), for
            these versions.
    """

    rule: ServeRule
    tolerance: float
    served: int
    newest: int
    best: int
    success: dict[int, float | None]

    def line(self) -> str:
        """One line for the end of a run and the report: the served version, its held-out
        success, the best one when it is another, and the rule that chose.

        >>> ServedChoice(ServeRule.NEWEST, 0.05, 8, 8, 4, {8: 0.266, 4: 0.297}).line()
        'served: v8 (0.266), the newest promoted version, within 0.05 of the best, v4 (0.297); --gate-rule best serves v4'
        >>> ServedChoice(ServeRule.BEST, 0.05, 4, 8, 4, {8: 0.266, 4: 0.297}).line()
        'served: v4 (0.297), the best held-out version (--gate-rule best); --gate-rule newest serves v8 (0.266)'
        """
        head = f"served: v{self.served} ({self._score(self.served)})"
        if self.newest == self.best:
            return head + ", the newest promoted version and the best held-out one"
        if self.rule == ServeRule.BEST:
            return (head + ", the best held-out version (--gate-rule best); "
                    f"--gate-rule newest serves v{self.newest} ({self._score(self.newest)})")
        return (head + f", the newest promoted version, within {self.tolerance:g} of the best, "
                f"v{self.best} ({self._score(self.best)}); --gate-rule best serves v{self.best}")

    def _score(self, version: int) -> str:
        x = self.success.get(version)
        return "not validated" if x is None else f"{x:.3f}"


def choose_served(versions: list[VersionRecord], rule: ServeRule | str, tolerance: float) -> ServedChoice:
    """The version to serve among ``versions`` (a ledger's rows) under ``rule``: ``newest``, the
    newest base or promoted version; ``best``, the base or promoted version with the highest
    held-out success, the newer on a tie (a version never validated ranks below any score).

    Raises:
        ValueError: no base or promoted version among ``versions``, or an unknown rule (the
            message lists the valid ones).
    """
    try:
        rule = ServeRule(rule)
    except ValueError:
        raise ValueError(f"unknown gate rule {rule!r}; valid: {', '.join(r.value for r in ServeRule)}") from None
    servable = [v for v in versions if v.servable]
    if not servable:
        raise ValueError("no base or promoted version to serve")
    newest = max(servable, key=lambda v: v.version)
    best = max(servable, key=lambda v: (-math.inf if v.val_success is None else v.val_success, v.version))
    served = newest if rule == ServeRule.NEWEST else best
    return ServedChoice(rule, tolerance, served.version, newest.version, best.version,
                        {v.version: v.val_success for v in (newest, best)})


def serve_by_rule(ledger: Ledger, rule: ServeRule | str, tolerance: float) -> tuple[ServedChoice, str | None]:
    """Make the version ``rule`` chooses (:func:`choose_served` over ``ledger.servable()``) the
    ledger's champion, its tensors loaded from its folder when it is not the champion already;
    returns the choice and a note when that version cannot be loaded (its folder damaged: the
    newest version is served instead, and the choice says so)."""
    from selfrl.record import adapters  # torch: not imported with the config, which reads ServeRule

    choice = choose_served(ledger.servable(), rule, tolerance)
    if choice.served == ledger.champion.version:
        return choice, None
    try:
        ledger.set_champion(choice.served, ledger.load_state(choice.served))
    except (KeyError, adapters.CorruptVersionError) as e:
        newest = choose_served(ledger.servable(), ServeRule.NEWEST, tolerance)
        return newest, (f"gate.rule = {choice.rule.value!r}: version {choice.served} cannot be loaded ({e}); "
                        f"serving version {ledger.champion.version}")
    return choice, None

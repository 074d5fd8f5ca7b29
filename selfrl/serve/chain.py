"""``gate.eval_every`` in ``selfrl serve``: the background learner's chain of candidates between
two validations.

With ``gate.eval_every = k`` (serve's default is 1: every candidate is validated) the learner
validates every k-th candidate. After an update whose candidate passed the cheap collapse rules
(the KL probe and the rules on the batch, :meth:`selfrl.run.cycle.UpdateCycle.observe`), while
fewer than k candidates were made since the last validation, that candidate is neither validated
nor served: the learner's model keeps its weights, and the next update trains on from them (its
parent). The k-th is validated by the gate:

* promoted: it is published; the chain's earlier candidates stay ``candidate`` (never validated,
  never servable, as the candidates between two validations of ``selfrl run``);
* rejected (or corrupt, or vetoed by a family): the learner goes back to the champion's weights,
  and the chain's earlier candidates are marked ``rejected`` too, a ``reject`` event each;
* a collapse (at the gate or by a cheap rule in the middle of the chain): the candidates since the
  champion are rolled back, as without a chain, and the chain ends.

An admin's rollback and a storage fault end a chain the same way (its candidates ``rejected``,
the champion's weights loaded again). Nothing unvalidated is ever served: only the gate publishes.

A chain does not outlive the process: after a restart the learner starts from the champion, and
a candidate the chain held stays ``candidate``, as one a killed validation left. While a chain is
under way the ledger's ``chain_head`` names the candidate whose weights the learner holds, so that
the age rule (:func:`selfrl.serve.late_feedback.version_tree`) counts the chain's weight changes.
"""

from __future__ import annotations

from typing import Any

from selfrl.record.versions import EventKind, Ledger, VersionStatus


class CandidateChain:
    """The unvalidated candidates the learner trained on from since its last validation.

    Args:
        ledger: the server's version ledger (its ``chain_head`` is kept here).
        every: ``gate.eval_every`` (>= 1): the candidates made per validation.
    """

    def __init__(self, ledger: Ledger, every: int):
        self.ledger, self.every = ledger, every
        self.pending: list[int] = []  # the chain's candidates, oldest first; the learner holds the last one's weights

    @property
    def current(self) -> int:
        """The version whose weights the learner holds between updates: the chain's newest
        candidate, else the champion (the next candidate's parent)."""
        return self.pending[-1] if self.pending else self.ledger.champion.version

    def due(self, version: int) -> bool:
        """After an update that saved ``version`` and passed the cheap collapse rules: True when
        it is the ``every``-th candidate since the last validation (validate it now); otherwise it
        joins the chain, unvalidated and unserved, and False."""
        if len(self.pending) + 1 >= self.every:
            return True
        self.pending.append(version)
        self.ledger.chain_head = version
        return False

    def status(self) -> dict[str, Any] | None:
        """``{"versions", "eval_every", "message"}`` while candidates wait for the gate, else None.
        ``message`` reads ``"chained: 1 of 2 before the gate"``: 1 candidate made of the 2 per validation."""
        if not self.pending:
            return None
        return {"versions": list(self.pending), "eval_every": self.every,
                "message": f"chained: {len(self.pending)} of {self.every} before the gate"}

    def settle(self, version: int) -> None:
        """After the update that saved ``version``: nothing while ``version`` waits in the chain;
        otherwise the chain ended with it (:meth:`end`)."""
        if version not in self.pending:
            self.end(f"the chain's last version {version} was not promoted")

    def end(self, why: str) -> list[int]:
        """End the chain. When the champion was trained from it (its last candidate was promoted),
        its candidates stay ``candidate``; otherwise each still ``candidate`` (a collapse rolls them
        back itself) is marked ``rejected`` (``{"unvalidated": why}``), with a ``reject`` event, and the
        caller loads the champion's weights. Returns the versions rejected."""
        rejected: list[int] = []
        with self.ledger.lock:  # an admin's rollback comes before or after, never inside
            for v in [] if self._promoted() else self.pending:
                rec = self.ledger.get(v)
                if rec is None or rec.status != VersionStatus.CANDIDATE:
                    continue
                self.ledger.store.set_version_status(v, VersionStatus.REJECTED.value, {"unvalidated": why})
                self.ledger.event(EventKind.REJECT, f"version {v} rejected unvalidated (gate.eval_every = "
                                  f"{self.every}): {why}; serving version {self.ledger.champion.version}",
                                  {"version": v})
                rejected.append(v)
            self._clear()
        return rejected

    def _promoted(self) -> bool:
        """Whether the champion descends from the chain's newest candidate (versions are numbered up)."""
        if not self.pending:
            return False
        rec = self.ledger.get(self.ledger.champion.version)
        while rec is not None and rec.parent is not None and rec.version > self.pending[-1]:
            rec = self.ledger.get(rec.parent)
        return rec is not None and rec.version == self.pending[-1]

    def _clear(self) -> None:
        self.pending = []
        self.ledger.chain_head = None

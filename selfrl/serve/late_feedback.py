"""The age rule (:mod:`selfrl.rl.feedback_age`) in ``selfrl serve``: what a served turn and the
feedback on it are worth when they reach the learner, minutes or days after the turn.

A served turn is stored with its exact token ids, the adapter version that sampled them and
its time (``served.created_at``, on the server's clock). Its judgement joins it there, however
late (:func:`selfrl.record.served.apply_feedback`). Then:

* **At the feedback** (:meth:`FeedbackAges.at_feedback`, the ``POST /v1/feedback`` answer):
  ``used`` when the learner still holds the turn's version (full weight at its next update),
  ``queued`` when the learner has moved since but the turn is within the cutoffs (it is weighed
  at the next update), ``too_old`` when it is past ``learner.max_feedback_age_versions`` weight
  changes or ``learner.max_feedback_age_s`` seconds (only recorded, never trained).
* **At the update** (:meth:`FeedbackAges.split` and :meth:`FeedbackAges.weights`): turns past a
  cutoff are left out (marked ``skipped``, the decision kept in ``reward_details``); a turn of
  an older version is trained with the truncated sequence weight ``min(exp(sum_t m_t (logp_now_t
  - logp_then_t)), learner.feedback_tis_cap)``, multiplied into its advantage.
* **Which turns an update takes** (:func:`take_batch`): the newest ready turns first
  (``learner.order = "newest"``, the default), after the pending turns already past a cutoff
  were expired in bulk (:func:`expire`: marked ``skipped`` with the same decision, an ``expire``
  event). Why newest first: a learner slower than its traffic that took the oldest turns first
  would train on turns one or more weight changes behind, each weighed down by the sequence
  weight, while the fresh ones waited behind them until they too were past the age rule, and
  from then on every batch was skipped whole as too old. Newest first, every update trains on
  the freshest data there is; what the learner cannot keep up with is what ages out, and the
  expiry keeps the pending turns bounded by the age rule. ``"oldest"`` (arrival order) trains
  every turn while the learner keeps up, for a replay of recorded traffic, say. With
  ``learner.learn_from_corrections`` on, the turns whose newest correction it takes come first, each
  part in that order: they are the scarcest signal, and behind newer turns they would age out.

Which correction, and why only one. The learner's per-token TIS (``train.tis_cap``,
:mod:`selfrl.rl.off_policy`) corrects each token for the sampler's own numerics. In ``serve``
the "sampler" log-probs it sees are the learner's recomputed ones (the served log-probs are
at the client's temperature, see :mod:`selfrl.serve.background`), so its weight is exactly 1
and the sequence weight is the only correction: it is the right one here because a judgement
is one reward for the whole turn (:mod:`selfrl.rl.feedback_age`). Multiplying both would count
the version gap twice. Both log-prob sequences are at ``learner.temperature``: ``logp_then``
is the turn's version loaded into the learner for one no-grad pass, ``logp_now`` the learner's
current weights.

How far a turn is behind is read from the version ledger, so it outlives a restart: every
candidate was trained from its parent, and the weight changes between a turn's version and the
weights the learner holds are counted along those links (:func:`version_tree`,
:func:`selfrl.rl.feedback_age.lineage_distance`). A rejected or rolled-back candidate's changes
are gone with its weights: they never count, and after a rollback the turns of the version
rolled back to are fresh again. With ``gate.eval_every`` above 1 the learner trains on from
candidates that are never served (:mod:`selfrl.serve.chain`): each is a weight change, but no
turn is ever sampled by one, so a turn's version is always a served one, behind by the chain's
changes, and by none of them once the chain is rejected.

When the learner's weights go back (a rejected chain, a rollback), turns that were expired only
because of the changes undone are within the rule again: they are pending again
(:func:`revive`, a ``revive`` event) and trained as any other. Expiry and revival run when an
update is due and whenever the weights the learner holds change (:func:`take_batch`), so the
pending count of ``GET /admin/status`` and the report holds no turn past the version cutoff for
longer than one ``learner.poll_s``; a turn that passes ``learner.max_feedback_age_s`` while the
weights stay put and no update is due is counted pending until then (it is never trained).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from selfrl.core.trajectory import Trajectory
from selfrl.record import served as records
from selfrl.record.store import Store, to_json
from selfrl.record.versions import EventKind, Ledger, VersionStatus
from selfrl.rl.feedback_age import (AgeDecision, AgePolicy, Outcome, decide_at, lineage_depths, lineage_distance,
                                    sequence_weight, versions_within)

# parents, the version held, its lineage_depths, and the versions retention pruned (version -> where they went)
Tree = tuple[dict[int, "int | None"], int, dict[int, int], dict[int, str]]


def version_tree(ledger: Ledger) -> tuple[dict[int, int | None], int]:
    """Every version's parent (None for a base), and the version whose weights the learner holds:
    the champion; while it trains on from unvalidated candidates (``gate.eval_every``, the ledger's
    ``chain_head``: :mod:`selfrl.serve.chain`) the newest of them, unless the chain did not start
    from the champion (an admin rolled back meanwhile: the learner goes back to the champion
    before its next update); on a replica, which holds no champion, the owner's newest servable row.

    Raises:
        ValueError: the ledger holds no version the learner could hold.

    >>> class L:  # 1 promoted, 2 rejected, 3 rolled back (both trained from 1), 4 from 1: champion 4
    ...     champion = type("C", (), {"version": 4})
    ...     def all(self):
    ...         return [type("V", (), {"version": v, "parent": p}) for v, p in [(0, None), (1, 0), (2, 1), (3, 1), (4, 1)]]
    >>> version_tree(L())
    ({0: None, 1: 0, 2: 1, 3: 1, 4: 1}, 4)
    """
    return tree_of(ledger.all(), ledger)


def tree_of(records: list, ledger: Ledger) -> tuple[dict[int, int | None], int]:
    """:func:`version_tree` from the ledger's rows ``records`` (:meth:`Ledger.all`), already read."""
    parents = {v.version: v.parent for v in records}
    head, champ = getattr(ledger, "chain_head", None), ledger.champion
    if head is not None and champ is not None:
        by = {v.version: v for v in records}
        root = by.get(head)
        while root is not None and root.status == VersionStatus.CANDIDATE and root.parent is not None:
            root = by.get(root.parent)  # back through the chain to where it was trained from
        if root is not None and root.version == champ.version:
            return parents, head
    if champ is not None:
        return parents, champ.version
    held = next((v.version for v in reversed(records) if v.servable), None)
    if held is None:
        raise ValueError("no version was loaded yet")
    return parents, held


class FeedbackAges:
    """The age rule of one learner: its policy (``[learner]``), the ledger and the clock."""

    def __init__(self, policy: AgePolicy, ledger: Ledger, clock: Callable[[], float] = time.time):
        self.policy, self.ledger, self.clock = policy, ledger, clock
        self._held: tuple | None = None  # (chain head, champion) at the last :meth:`moved`
        self.within: set[int] | None = None  # the versions within the rule at the last :func:`revive`

    @classmethod
    def from_config(cls, lc, ledger: Ledger, clock: Callable[[], float] = time.time) -> "FeedbackAges":
        """From ``[learner]``: ``max_feedback_age_versions``, ``max_feedback_age_s``, ``feedback_tis_cap``."""
        return cls(AgePolicy(lc.max_feedback_age_versions, lc.max_feedback_age_s, lc.feedback_tis_cap), ledger, clock)

    def tree(self) -> Tree:
        """:func:`version_tree` of the ledger now, with the held version's :func:`lineage_depths` and
        the versions whose folders retention pruned (``{version: where}``)."""
        records = self.ledger.all()
        parents, held = tree_of(records, self.ledger)
        return parents, held, lineage_depths(held, parents), pruned(records)

    def held(self) -> int:
        """The version whose weights the learner holds (a turn of it is never behind)."""
        return tree_of(self.ledger.all(), self.ledger)[1]

    def decide(self, version: int, created_at: float, now: float, tree: Tree) -> AgeDecision:
        """The age rule for a turn of ``version`` stored at ``created_at`` (seconds), at ``now``. A turn
        of a version the learner has moved from whose weights retention pruned is ``too_old``: its
        log-probs, which weigh it, cannot be computed any more (retention prunes only versions past the
        rule; a rejection or a rollback can put one within it again)."""
        parents, held, depths, gone = tree
        behind = lineage_distance(version, held, parents, depths)
        d = decide_at(version, behind, held, created_at, max(now, created_at), self.policy)
        if d.outcome is not Outcome.TOO_OLD and behind > 0 and version in gone:
            return AgeDecision(Outcome.TOO_OLD, None, behind, d.age_s, f"only recorded: the weights of version "
                               f"{version} are no longer stored (pruned by retention: {gone[version]})")
        return d

    def at_feedback(self, version: int, created_at: float, note: bool = False) -> tuple:
        """``(outcome, reason)`` for feedback on a turn of ``version`` stored at ``created_at``
        (see the module docstring); the rule :func:`selfrl.record.served.apply_feedback` applies.
        With ``note``, the decision as a turn left out keeps it (:func:`describe`) third: a pending
        turn the feedback leaves out keeps it, so that :func:`revive` brings it back as an expired
        one. A clock behind the stored time (a restart) reads as age 0."""
        d = self.decide(version, created_at, self.clock(), self.tree())
        return (d.outcome.value, d.reason, describe(d)) if note else (d.outcome.value, d.reason)

    def split(self, batch: list[tuple[Trajectory, dict]]) -> tuple[list[tuple[Trajectory, dict]],
                                                                 list[tuple[Trajectory, AgeDecision]]]:
        """Turns within the cutoffs, and those past one with their decision (to leave out)."""
        tree, now = self.tree(), self.clock()
        kept, old = [], []
        for traj, row in batch:
            d = self.decide(traj.adapter_version, row["created_at"], now, tree)
            if d.outcome is Outcome.TOO_OLD:
                traj.reward_details.setdefault("user_feedback", {})["age"] = describe(d)
                old.append((traj, d))
            else:
                kept.append((traj, row))
        return kept, old

    def needed(self) -> set[int]:
        """The versions whose turns the age rule may still train on (:func:`versions_within` of the
        version the learner holds), but for those behind it whose weights retention pruned (see
        :meth:`decide`): a late judgement may need their weights, so version retention keeps their
        folders."""
        parents, held, _, gone = self.tree()
        return versions_within(held, parents, self.policy.max_versions) - (gone.keys() - {held})

    def moved(self) -> bool:
        """Whether the weights the learner holds (the champion, or a chain's newest candidate) are
        other than at the last call (True at the first): the ages of the stored turns changed."""
        champ = getattr(self.ledger.champion, "version", None)
        held, self._held = self._held, (getattr(self.ledger, "chain_head", None), champ)
        return held != self._held

    def behind(self, trajs: list[Trajectory]) -> dict[int, list[Trajectory]]:
        """The turns sampled by a version the learner has moved from, by version."""
        parents, held, depths, _ = self.tree()
        out: dict[int, list[Trajectory]] = {}
        for t in trajs:
            if lineage_distance(t.adapter_version, held, parents, depths) > 0:
                out.setdefault(t.adapter_version, []).append(t)
        return out

    def weights(self, trajs: list[Trajectory], now_logps: dict[str, list[float]],
                then_logps: dict[str, list[float]]) -> list[float]:
        """The sequence weight of each turn (1.0 for one of the current version).

        Args:
            trajs: the turns, with ``completion_mask`` (T,).
            now_logps: ``{id: (T,) log-probs under the current weights}`` at ``learner.temperature``.
            then_logps: the same under the turn's own version, for the turns that are behind.
        """
        out = []
        for t in trajs:
            if t.id in then_logps:
                w = sequence_weight(now_logps[t.id], then_logps[t.id], t.completion_mask, self.policy.tis_cap)
            else:
                w = 1.0
            t.reward_details.setdefault("user_feedback", {})["age"] = {"outcome": "used", "weight": w}
            out.append(w)
        return out


    def weigh(self, train: list[Trajectory], originals: list[Trajectory],
              logps_under: Callable[[int, list[Trajectory]], list[list[float]]]) -> dict[str, float]:
        """Multiply each training copy's advantage by its turn's sequence weight.

        Args:
            train: the copies the update trains on; their ``logprobs`` are the current weights'.
            originals: the stored turns, in the same order (they keep the decision for the record).
            logps_under: ``logps_under(version, turns)``: (T,) log-probs of each turn under
                ``version``'s weights at ``learner.temperature`` (the learner loads it for one
                no-grad pass and loads its own back); raises ``FileNotFoundError`` or
                ``ValueError`` when the version's weights are gone (such turns get weight 0).

        Returns:
            metrics: ``feedback/behind`` (turns of an older version whose weights are stored) and
            ``feedback/weight_mean`` (over the turns whose version's weights are stored; the others
            get weight 0, are marked ``too_old`` and are for the caller to leave out).
        """
        then: dict[str, list[float]] = {}
        gone: set[str] = set()
        for version, turns in self.behind(train).items():
            try:
                then.update({t.id: lp for t, lp in zip(turns, logps_under(version, turns))})
            except (FileNotFoundError, ValueError):
                gone.update(t.id for t in turns)
        weights = self.weights(originals, {t.id: t.logprobs for t in train}, then)
        for copy, orig, i in zip(train, originals, range(len(weights))):
            if copy.id in gone:
                weights[i] = 0.0
                orig.reward_details["user_feedback"]["age"] = {"outcome": "too_old", "weight": None, "reason": (
                    f"only recorded: the weights of version {copy.adapter_version} are no longer stored")}
            copy.advantage = copy.advantage * weights[i]
        kept = [w for t, w in zip(train, weights) if t.id not in gone]  # the caller leaves the gone ones out
        return {"feedback/behind": float(len(then)),
                "feedback/weight_mean": sum(kept) / len(kept) if kept else 1.0}


def pruned(records: list) -> dict[int, str]:
    """``{version: where its folder went}`` for the ledger's rows ``records`` that retention pruned."""
    out = {}
    for v in records:
        metrics = getattr(v, "metrics", None) or {}
        if metrics.get("pruned"):
            out[v.version] = str(metrics.get("pruned_to") or "pruned")
    return out


def describe(d: AgeDecision) -> dict:
    """An age decision as stored in a turn's ``reward_details["user_feedback"]["age"]``
    (``versions_behind`` None for a version the learner never held)."""
    k = None if d.versions_behind == float("inf") else d.versions_behind
    return {"outcome": d.outcome.value, "weight": d.weight, "versions_behind": k, "age_s": d.age_s,
            "reason": d.reason}


def take_batch(store: Store, ages: FeedbackAges, lc) -> list[tuple[Trajectory, dict]]:
    """The learner's next batch: up to ``lc.max_batch`` ready turns (:func:`selfrl.record.served.ready`:
    feedback arrived or ``lc.feedback_wait_s`` passed), in ``lc.order`` (newest first by default:
    see the module docstring), those whose newest correction ``lc.learn_from_corrections`` takes
    first (a learner slower than its traffic would otherwise leave most of them waiting until they
    age out: in a 90-minute soak 170 of 239 call corrections were never taken). When at least
    ``lc.min_batch`` are ready (an update is due), or the weights the learner holds changed since
    the last call (:meth:`FeedbackAges.moved`: a promotion, a chained candidate, a rejection, a
    rollback), the turns within the age rule again are brought
    back (:func:`revive`), the pending turns past it expired (:func:`expire`), and the batch taken
    again. A turn still waiting for its feedback is never taken nor expired.

    Args:
        lc: ``[learner]`` (``feedback_wait_s``, ``min_batch``, ``max_batch``, ``order``, ``learn_from_corrections``).

    Returns:
        ``(trajectory, served row)`` pairs, fewer than ``lc.min_batch`` when no update is due.
    """
    def take():
        return records.ready(store, lc.feedback_wait_s, lc.max_batch, now=ages.clock(), order=lc.order,
                             corrected_first=lc.learn_from_corrections)

    batch = take()
    moved = ages.moved()  # (every call: it keeps the weights it saw)
    if moved or len(batch) >= lc.min_batch:
        keep = ages.needed()
        if revive(store, ages, keep) + expire(store, ages, lc.feedback_wait_s, keep=keep):
            batch = take()
    return batch


def expire(store: Store, ages: FeedbackAges, wait_s: float, chunk: int = 256, keep: set[int] | None = None) -> int:
    """Mark ``skipped`` every pending turn whose reward is complete (feedback arrived, or ``wait_s``
    seconds passed) and that is past the age rule: sampled more than ``max_feedback_age_versions``
    weight changes ago (or by a version this learner never held), or older than
    ``max_feedback_age_s``. Each keeps its decision in ``reward_details["user_feedback"]["age"]``,
    as a turn the update leaves out (:meth:`FeedbackAges.split`), so feedback on it is answered
    ``too_old`` with the same reason; its trajectory stays stored. One transaction per ``chunk``
    turns; one ``expire`` event (reason ``too_old``, :func:`stale_note` its message) when any.
    ``keep``: :meth:`FeedbackAges.needed`, when already at hand.

    Returns:
        how many turns were expired.

    Raises:
        sqlite3.Error: the store cannot be written; the turns of the chunk under way stay pending.
    """
    keep, n, versions = ages.needed() if keep is None else keep, 0, set()
    while True:
        with store.lock:  # no feedback lands between the read and the mark
            now = ages.clock()
            rows = records.ready_past(store, wait_s, keep, now - ages.policy.max_age_s, chunk, now=now)
            _, old = ages.split(rows)
            records.mark(store, [t for t, _ in old], "skipped", None)
        n, versions = n + len(old), versions | {t.adapter_version for t, _ in old}
        if len(rows) < chunk or not old:
            break
    if n:
        note = past_age_note(n, sorted(versions), ages.policy)
        ages.ledger.event(EventKind.EXPIRE, f"expired: {note}",
                          {"reason": "too_old", "expired": n, "versions": sorted(versions)})
    return n


def revive(store: Store, ages: FeedbackAges, keep: set[int]) -> int:
    """Bring back (``pending``) the turns the age rule left out for their version's distance whose
    version is within it again: the learner's weights went back (a rejected chain, a rollback),
    so the weight changes that made them too old are undone. Only the versions of ``keep``
    (:meth:`FeedbackAges.needed`) that were not within the rule at the last call
    (:attr:`FeedbackAges.within`; all of them at the first) are read: nothing, when none went back. A turn comes back when it is ``skipped`` with an age decision
    that counted its version's distance (``too_old`` with ``versions_behind``: expired, left out
    by an update, or by its feedback's answer), is not cut off and is within ``max_feedback_age_s``; its decision is
    dropped (the next update decides again). One ``revive`` event when any.

    Returns:
        how many turns came back.

    Raises:
        sqlite3.Error: the store cannot be read or written; nothing changes.
    """
    versions = sorted(keep - (ages.within or set()))
    if not versions:
        ages.within = set(keep)
        return 0
    back, came = [], set()
    with store.lock:  # no feedback lands between the read and the write
        rows = store.conn.execute(
            "SELECT t.id, t.adapter_version, t.data_json FROM served s JOIN trajectories t ON t.id = s.trajectory_id"
            f" WHERE s.status = 'skipped' AND s.created_at >= ? AND t.adapter_version IN ({','.join('?' * len(versions))})",
            (ages.clock() - ages.policy.max_age_s, *versions)).fetchall()
        for r in rows:
            data = json.loads(r["data_json"])
            judged = (data.get("reward_details") or {}).get("user_feedback") or {}
            age = judged.get("age") or {}
            if data.get("error") or age.get("outcome") != "too_old" or age.get("versions_behind") is None:
                continue
            del judged["age"]
            back.append((to_json(data), r["id"]))
            came.add(int(r["adapter_version"]))
        with store.conn:
            store.conn.executemany("UPDATE trajectories SET data_json = ? WHERE id = ?", back)
            store.conn.executemany("UPDATE served SET status = 'pending' WHERE trajectory_id = ?",
                                   [(tid,) for _, tid in back])
    ages.within = set(keep)  # after the write: a failed one is tried again
    if back:
        ages.ledger.event(EventKind.REVIVE, f"{len(back)} turn(s) sampled by versions {sorted(came)} are within the "
                          "age rule again (the learner's weights went back: a rejection or a rollback undid the "
                          "weight changes that made them too old): pending again",
                          {"revived": len(back), "versions": sorted(came)})
    return len(back)


def past_age_note(n: int, versions: list[int], policy: AgePolicy) -> str:
    """``n`` turns of ``versions`` past the age rule ``policy``: the cutoffs and what to change."""
    return (f"{n} turn(s) sampled by versions {versions} were past the age rule "
            f"(learner.max_feedback_age_versions = {policy.max_versions} weight changes, "
            f"max_feedback_age_s = {policy.max_age_s:g}): the learner is behind the traffic; they are only "
            "recorded (raise the cutoff, send less traffic, or validate less often: gate.eval_every)")


def stale_note(too_old: list, gone: list[Trajectory], policy: AgePolicy) -> str:
    """Why an update had nothing to train on but turns past the age rule (``too_old``: pairs of a
    turn and its :class:`~selfrl.rl.feedback_age.AgeDecision`) or whose version's weights are
    gone (``gone``): the counts, the versions, the cutoffs and what to change."""
    parts = []
    if too_old:
        parts.append(past_age_note(len(too_old), sorted({t.adapter_version for t, _ in too_old}), policy))
    if gone:
        versions = sorted({t.adapter_version for t in gone})
        parts.append(f"every turn with a signal ({len(gone)}) was sampled by a version whose weights are no longer "
                     f"stored or cannot be read (versions {versions}): only recorded (version retention keeps "
                     "every served version the age rule may still train on)")
    return "; ".join(parts)

"""What the server stores besides the trajectories themselves: one ``served`` row per
returned choice (response id, conversation link, group key, training status, the
user feedback that reached it), every feedback message as it arrived, and the
conversation behind each recent Responses API id (``previous_response_id``).

The tables live in the run's SQLite store next to ``trajectories``. The choices of a
response are written with their trajectories in one transaction (all or none), and
feedback is applied in one transaction, so a crash, a bad request or a full disk never
leaves half a record. A response is acknowledged (its client gets a 200, or a stream's
last chunk and ``[DONE]``) only after its transaction committed.
Every function here takes ``store.lock`` itself (the server shares one connection
between threads).

Training status of a served trajectory: ``pending`` (waiting for a reward),
``trained`` (used by the update that made version ``trained_in``), ``skipped``
(no reward component applied, or past the age rule: :func:`ready_past`; never trained).

The tables, and bringing an older store up to date: :mod:`selfrl.record.served_schema`.

Old turns leave through retention (:mod:`selfrl.serve.retention`): :func:`old_turns` reads
them as export rows, :func:`delete_turns` deletes them with their feedback, in one transaction.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from selfrl.record.served_feedback import SOURCE_RANK, attach  # noqa: F401  (where a value lands)
from selfrl.record.served_feedback import chain as _chain
from selfrl.record.served_schema import FEEDBACK_COLUMNS, SERVE_SCHEMA, init  # noqa: F401  (the tables)
from selfrl.record.store import Store, real, to_json
from selfrl.core.trajectory import Trajectory


def locked(fn):
    """Run a function of this module under its store's own lock (the first argument)."""

    @functools.wraps(fn)
    def call(store: Store, *args, **kwargs):
        with store.lock:
            return fn(store, *args, **kwargs)

    return call


@dataclass(frozen=True)
class ServedTurn:
    """One returned choice to store: its trajectory and the ``served`` row's fields.
    ``client`` is the requesting client's identity (``feedback.client_identity``); ``family`` the
    request's ``metadata.family`` (``[[families]]``, :mod:`selfrl.safety.families`), or None;
    ``tools`` the tools the turn could call, ``[{"name", "parameters"}]`` (``[]``: none, or
    ``tool_choice`` "none"), or None when not known: a correction's calls are checked against
    them (:func:`selfrl.serve.corrections.offered_problem`)."""

    traj: Trajectory
    response_id: str
    choice: int
    conversation_id: str
    group_key: str
    continuation: str
    client: str = ""
    family: str | None = None
    tools: list[dict[str, Any]] | None = None


@locked
def add_turns(store: Store, run_id: int, turns: list[ServedTurn], now: float | None = None) -> None:
    """Store the choices of one response, each trajectory with its ``served`` row, all in
    one transaction: a response is recorded whole or not at all. ``now``: the ``created_at``
    of the rows (the server's clock, ``time.time()`` by default), from which a turn's age counts.
    A parent turn pruned by retention meanwhile (:func:`delete_turns`) is no link: the row's
    ``parent_id`` is NULL (the trajectory's record keeps the id).

    Raises:
        sqlite3.IntegrityError: a duplicate id; nothing is written.
        sqlite3.OperationalError: the store cannot be written (disk full, locked; see
            ``selfrl.record.storage_errors``); nothing is written.
    """
    now = time.time() if now is None else now
    with store.conn:
        for t in turns:
            store.insert_trajectory(run_id, 0, t.traj, now)
            store.conn.execute(
                "INSERT INTO served (trajectory_id, response_id, choice, conversation_id, parent_id, group_key,"
                " continuation, created_at, status, client, family, tools) VALUES (?, ?, ?, ?,"
                " (SELECT id FROM trajectories WHERE id = ?), ?, ?, ?, 'pending', ?, ?, ?)",  # a pruned parent: NULL
                (t.traj.id, t.response_id, t.choice, t.conversation_id, t.traj.parent_id, t.group_key,
                 t.continuation, now, t.client, t.family, None if t.tools is None else json.dumps(t.tools)),
            )


def add_turn(store: Store, run_id: int, traj: Trajectory, response_id: str, choice: int,
             conversation_id: str, group_key: str, continuation: str, client: str = "") -> None:
    """Store one served choice: :func:`add_turns` of one :class:`ServedTurn`."""
    add_turns(store, run_id, [ServedTurn(traj, response_id, choice, conversation_id, group_key, continuation,
                                         client)])


@locked
def find_by_continuation(store: Store, key: str, client: str) -> dict[str, Any] | None:
    """The latest turn served to ``client`` whose conversation-so-far hashes to ``key``, or
    None (always None for an anonymous client, ``""``: see ``selfrl.serve.feedback``)."""
    if not client:
        return None
    row = store.conn.execute(
        "SELECT * FROM served WHERE continuation = ? AND client = ? ORDER BY created_at DESC LIMIT 1", (key, client)
    ).fetchone()
    return None if row is None else dict(row)


@locked
def find_response(store: Store, response_id: str, choice: int = 0) -> dict[str, Any] | None:
    """The ``served`` row of a response's choice, or None."""
    row = store.conn.execute(
        "SELECT * FROM served WHERE response_id = ? AND choice = ?", (response_id, choice)
    ).fetchone()
    return None if row is None else dict(row)


@locked
def chain(store: Store, trajectory_id: str, limit: int = 100) -> list[str]:
    """``trajectory_id`` and its ancestors (earlier turns of the conversation), latest first."""
    return _chain(store.conn, trajectory_id, limit)


@dataclass(frozen=True)
class FeedbackApplied:
    """Where a feedback value landed.

    Attributes:
        updated: pending turns whose value changed; a later update trains on it.
        too_late: turns already trained or skipped whose value changed for the record
            only: no update will use it (the learner never trains a turn twice).
    """

    updated: int
    too_late: int
    outcome: str = "used"  # the judged turn's: used | queued | too_old (only recorded) | comment_only
    reason: str = ""


# The judged turn's age decision: ``age(adapter_version, created_at) -> (outcome, reason[, stored decision])``.
AgeRule = Callable[[int, float], tuple]


@locked
def apply_feedback(store: Store, response_id: str, choice: int, source: str, value: float | None,
                   rating: float | None = None, corrected: bool = False, correction: str | None = None,
                   comment: str | None = None, now: float | None = None,
                   age: AgeRule | None = None, correction_calls: list[dict[str, Any]] | None = None) -> FeedbackApplied:
    """Record feedback on a response and attach its value to the turn and its earlier turns.

    The turn itself gets ``source`` (``explicit`` or ``implicit``); its ancestors get ``inherited`` (explicit)
    or ``implicit``. A value never replaces one from a stronger source (:data:`SOURCE_RANK`). Turns already
    trained or skipped keep the value for the record but are never trained on: they count as ``too_late``.

    With ``age`` (the learner's age rule), the judged turn itself is decided: ``too_old`` leaves it only
    recorded (a pending turn is marked ``skipped``, with the rule's decision when it gives one, as a turn the
    learner leaves out: so it may come back); ``used`` or ``queued`` keeps it pending, or brings back a turn
    that was skipped for want of a reward (not cut off, never trained) so that the feedback reaches an update
    however late it came. A turn already trained is never trained twice (``too_old``, "already trained").
    ``now``: the feedback's ``created_at`` (the server's clock; ``time.time()`` by default).
    ``correction_calls``: the calls the corrected answer makes (``[{"name", "arguments": {...}}]``),
    stored as JSON beside ``correction`` (:func:`corrections` reads both back).

    ``value`` None: the message judges nothing (a comment alone). It is stored, and nothing else
    changes: no turn's value, no turn's status (the age rule is not applied); the outcome is
    ``comment_only``, whose reason gives the value the turn holds, if any.

    Raises:
        KeyError: no such response (nothing is written).
    """
    row = find_response(store, response_id, choice)
    if row is None:
        raise KeyError(f"no response {response_id!r} with choice {choice}")
    now = time.time() if now is None else now
    own = row["trajectory_id"]
    outcome, reason, *decision = _judged_turn(store, row, age) if value is not None else _unjudged(row)
    with store.conn:
        store.conn.execute(
            "INSERT INTO feedback (response_id, choice, source, value, rating, corrected, correction, correction_calls,"
            " comment, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (response_id, choice, source, value, rating, int(corrected), correction,
             None if correction_calls is None else json.dumps(correction_calls), comment, now),
        )
        if value is None:
            return FeedbackApplied(0, 0, outcome, reason)
        if age is not None and outcome != "too_old" and row["status"] == "skipped":
            store.conn.execute("UPDATE served SET status = 'pending' WHERE trajectory_id = ?", (own,))
        elif age is not None and outcome == "too_old" and row["status"] == "pending":
            store.conn.execute("UPDATE served SET status = 'skipped' WHERE trajectory_id = ?", (own,))
            if decision:  # kept as a turn the learner leaves out keeps it (late_feedback.describe)
                t = json.loads(store.conn.execute("SELECT data_json FROM trajectories WHERE id = ?", (own,)).fetchone()[0])
                t["reward_details"].setdefault("user_feedback", {})["age"] = decision[0]
                store.conn.execute("UPDATE trajectories SET data_json = ? WHERE id = ?", (to_json(t), own))
        changed, late = attach(store.conn, own, source, value)
    return FeedbackApplied(changed, late, outcome, reason)


def _unjudged(row: dict[str, Any]) -> tuple[str, str]:
    """``("comment_only", reason)`` of a message that judges nothing, on the turn ``row``."""
    held = ("it has no feedback value yet" if row["feedback"] is None else
            f"it keeps its feedback value {row['feedback']:g} ({row['feedback_source']})")
    return "comment_only", ("recorded, the turn unchanged: a comment alone is no judgement (rate it with rating, "
                            f"or send corrected: true or a correction); {held}")


def _judged_turn(store: Store, row: dict[str, Any], age: AgeRule | None) -> tuple:
    """``(outcome, reason[, decision])`` of feedback on the turn ``row`` (see :func:`apply_feedback`)."""
    status = row["status"]
    if status == "trained":
        return "too_old", f"only recorded: the turn was already trained on (version {row['trained_in']})"
    t = store.conn.execute("SELECT adapter_version, data_json FROM trajectories WHERE id = ?",
                           (row["trajectory_id"],)).fetchone()
    if status == "skipped" and json.loads(t["data_json"]).get("error"):
        return "too_old", "only recorded: the turn was cut off and is never trained"
    age_note = ((json.loads(t["data_json"]).get("reward_details") or {}).get("user_feedback") or {}).get("age") or {}
    if status == "skipped" and age_note.get("outcome") == "too_old":
        return "too_old", age_note.get("reason") or "only recorded: the turn was left out as too old"
    if age is None:
        return ("used", "a later update trains on it") if status == "pending" else (
            "too_old", "only recorded: the turn was already skipped")
    return age(int(t["adapter_version"]), float(row["created_at"]))


READY = "s.status = 'pending' AND (s.feedback IS NOT NULL OR s.created_at <= ?)"  # a reward is complete
ORDERS = {"oldest": "s.created_at, s.rowid", "newest": "s.created_at DESC, s.rowid DESC"}


_SAYS = {"calls": "COALESCE(correction_calls, '[]') != '[]'",  # an explicit feedback row's correction says the answer
         "all": "(COALESCE(correction_calls, '[]') != '[]' OR TRIM(COALESCE(correction, ''), ' ' || char(9, 10, 13)) != '')"}


@locked
def ready(store: Store, wait_s: float, limit: int, now: float | None = None,
          order: str = "oldest", corrected_first: str = "off") -> list[tuple[Trajectory, dict[str, Any]]]:
    """Pending turns whose reward is complete: feedback arrived, or ``wait_s`` seconds passed.

    Args:
        order: ``"oldest"`` or ``"newest"`` first, by ``created_at`` (``learner.order``).
        corrected_first: ``learner.learn_from_corrections``: unless ``"off"``, the turns whose newest correction
            (:func:`corrections`) that setting takes (``"calls"``: one with calls) come first, each part in ``order``.

    Returns:
        up to ``limit`` ``(trajectory, served row)`` pairs, in that order.

    Raises:
        ValueError: an ``order`` other than those two, or a ``corrected_first`` other than off, calls, all.
    """
    if order not in ORDERS:
        raise ValueError(f"order must be one of {', '.join(map(repr, ORDERS))}, got {order!r}")
    if corrected_first not in ("off", *_SAYS):
        raise ValueError(f"corrected_first must be 'off', 'calls' or 'all', got {corrected_first!r}")
    first = "" if corrected_first == "off" else (  # the newest correction that says something, as corrections()
        f"COALESCE((SELECT {_SAYS[corrected_first]} FROM feedback WHERE response_id = s.response_id AND choice ="
        f" s.choice AND source = 'explicit' AND {_SAYS['all']} ORDER BY id DESC LIMIT 1), 0) DESC, ")
    now = time.time() if now is None else now
    return _pairs(store.conn.execute(
        "SELECT s.*, t.data_json FROM served s JOIN trajectories t ON t.id = s.trajectory_id"
        f" WHERE {READY} ORDER BY {first}{ORDERS[order]} LIMIT ?", (now - wait_s, limit)).fetchall())


@locked
def ready_past(store: Store, wait_s: float, keep_versions: set[int], before: float, limit: int,
               now: float | None = None) -> list[tuple[Trajectory, dict[str, Any]]]:
    """Those of the turns :func:`ready` would give that are past an age cutoff: sampled by a
    version not in ``keep_versions``, or stored before ``before`` (seconds, the server's clock).
    A turn still waiting for feedback is not among them. Returns up to ``limit`` pairs, oldest first."""
    now = time.time() if now is None else now
    versions = f"t.adapter_version NOT IN ({','.join('?' * len(keep_versions))})" if keep_versions else "1"
    return _pairs(store.conn.execute(
        "SELECT s.*, t.data_json FROM served s JOIN trajectories t ON t.id = s.trajectory_id"
        f" WHERE {READY} AND ({versions} OR s.created_at < ?) ORDER BY {ORDERS['oldest']} LIMIT ?",
        (now - wait_s, *sorted(keep_versions), before, limit)).fetchall())


def _pairs(rows) -> list[tuple[Trajectory, dict[str, Any]]]:
    """``(trajectory, served row)`` of each row read with its trajectory's ``data_json``."""
    return [(Trajectory.from_dict(json.loads(r["data_json"])), {k: r[k] for k in r.keys() if k != "data_json"})
            for r in rows]


@locked
def corrections(store: Store, turns: list[tuple[str, int]]) -> dict[tuple[str, int], tuple[str, list[dict[str, Any]]]]:
    """The newest explicit correction of each of ``turns`` (``(response_id, choice)``) that says
    what the answer should have been: ``{turn: (text, calls)}`` (``text`` "" when only calls were
    given, ``calls`` ``[{"name", "arguments": {...}}]`` or []). A turn whose feedback carries
    no correction text (but blank space) or calls is absent."""
    out: dict[tuple[str, int], tuple[str, list[dict[str, Any]]]] = {}
    for rid, choice in turns:
        row = store.conn.execute(
            "SELECT correction, correction_calls FROM feedback WHERE response_id = ? AND choice = ? AND"
            f" source = 'explicit' AND {_SAYS['all']} ORDER BY id DESC LIMIT 1", (rid, choice)).fetchone()
        if row is not None:
            out[(rid, choice)] = (row[0] or "", json.loads(row[1]) if row[1] else [])
    return out


@locked
def versions_with_untrained_turns(store: Store, versions: set[int]) -> set[int]:
    """Those of ``versions`` that sampled a served turn not yet trained on (pending, or skipped
    and so still open to late feedback): the versions a late judgement may be weighed by."""
    if not versions:
        return set()
    marks = ",".join("?" * len(versions))
    rows = store.conn.execute(
        "SELECT DISTINCT t.adapter_version FROM served s JOIN trajectories t ON t.id = s.trajectory_id"
        f" WHERE s.status != 'trained' AND t.adapter_version IN ({marks})", sorted(versions)).fetchall()
    return {int(r[0]) for r in rows}


@locked
def mark(store: Store, scored: list[Trajectory], status: str, version: int | None) -> None:
    """Write the rewards the learner gave ``scored`` and set their status, in one transaction."""
    with store.conn:
        for t in scored:
            store.conn.execute(
                "UPDATE trajectories SET reward = ?, data_json = ? WHERE id = ?", (real(t.reward), to_json(t.to_dict()), t.id)
            )
            store.conn.executemany(
                "INSERT OR REPLACE INTO rewards (trajectory_id, name, value) VALUES (?, ?, ?)",
                [(t.id, name, real(v)) for name, v in t.rewards.items()],
            )
            store.conn.execute("UPDATE served SET status = ?, trained_in = ? WHERE trajectory_id = ?",
                               (status, version, t.id))


@locked
def learned_families(store: Store) -> set[str]:
    """The families the learner has trained on: those named by at least one turn marked
    ``trained`` (whatever became of the version it went into)."""
    rows = store.conn.execute("SELECT DISTINCT family FROM served WHERE status = 'trained' AND family IS NOT NULL")
    return {r[0] for r in rows}


@locked
def mark_cut_off(store: Store, response_id: str, reason: str) -> int:
    """Mark every choice of ``response_id`` cut off: its trajectory gets ``error`` =
    ``reason`` and ``truncated``, its served row ``skipped`` (never trained on), in one
    transaction. Returns the number of turns marked."""
    rows = store.conn.execute(
        "SELECT t.id, t.data_json FROM served s JOIN trajectories t ON t.id = s.trajectory_id"
        " WHERE s.response_id = ?", (response_id,)).fetchall()
    with store.conn:
        for r in rows:
            data = json.loads(r["data_json"])
            data.update(error=reason, truncated=True)
            store.conn.execute("UPDATE trajectories SET data_json = ? WHERE id = ?", (to_json(data), r["id"]))
            store.conn.execute("UPDATE served SET status = 'skipped' WHERE trajectory_id = ?", (r["id"],))
    return len(rows)


@locked
def counts(store: Store) -> dict[str, int]:
    """Served turns by status, and how many pending ones have feedback."""
    out = {s: 0 for s in ("pending", "trained", "skipped")}
    for r in store.conn.execute("SELECT status, COUNT(*) AS n FROM served GROUP BY status"):
        out[r["status"]] = int(r["n"])
    out["pending_with_feedback"] = int(store.conn.execute(
        "SELECT COUNT(*) FROM served WHERE status = 'pending' AND feedback IS NOT NULL").fetchone()[0])
    out["feedback_messages"] = int(store.conn.execute("SELECT COUNT(*) FROM feedback").fetchone()[0])
    return out


def turn_history(store: Store) -> list[dict[str, Any]]:
    """Every served turn, oldest first: ``{run_id, created_at, adapter_version, status,
    trained_in, feedback, feedback_source}`` (for the serving report)."""
    rows = store.conn.execute(
        "SELECT t.run_id, s.created_at, t.adapter_version, s.status, s.trained_in, s.feedback, s.feedback_source"
        " FROM served s JOIN trajectories t ON t.id = s.trajectory_id ORDER BY s.created_at"
    )
    return [dict(r) for r in rows]


def feedback_history(store: Store) -> list[dict[str, Any]]:
    """Every feedback message as it arrived, oldest first: ``{created_at, source, value}``."""
    rows = store.conn.execute("SELECT created_at, source, value FROM feedback ORDER BY created_at, id")
    return [dict(r) for r in rows]


def old_turns(store: Store, cutoff: float, limit: int, keep: tuple[str, ...] = ()) -> tuple[list[dict[str, Any]], int]:
    """The oldest served turns stored before ``cutoff``, as export rows, for retention
    (:mod:`selfrl.serve.retention` decides the cutoff). The store's lock is held while the rows
    are read, not while their records are decoded.

    Args:
        cutoff: ``served.created_at`` (the server's clock, seconds) a turn must be older than.
        limit: at most this many turns.
        keep: families (``served.family``) whose newest trained turn stays whatever its age: it is
            what makes the family learned (:func:`learned_families`).

    Returns:
        ``(rows, last_feedback)``: one dict per turn, oldest first, ``{id, created_at, run_id,
        trajectory, served, feedback}`` (``trajectory``: its full record; ``served``: its served row;
        ``feedback``: every feedback message on its response's choice, oldest first), and the
        highest ``feedback.id`` when they were read (:func:`delete_turns` checks that none came since).
    """
    with store.lock:
        kept = set()
        for family in keep:
            row = store.conn.execute("SELECT trajectory_id FROM served WHERE status = 'trained' AND family = ?"
                                     " ORDER BY created_at DESC LIMIT 1", (family,)).fetchone()
            if row is not None:
                kept.add(row[0])
        rows = store.conn.execute(
            "SELECT s.*, t.run_id, t.data_json FROM served s JOIN trajectories t ON t.id = s.trajectory_id"
            " WHERE s.created_at < ? ORDER BY s.created_at, s.rowid LIMIT ?", (cutoff, limit + len(kept))).fetchall()
        rows = [r for r in rows if r["trajectory_id"] not in kept][:limit]
        last_feedback = int(store.conn.execute("SELECT COALESCE(MAX(id), 0) FROM feedback").fetchone()[0])
        feedback = [[dict(f) for f in store.conn.execute(
            "SELECT * FROM feedback WHERE response_id = ? AND choice = ? ORDER BY id", (r["response_id"], r["choice"]))]
            for r in rows]
    out = []
    for r, messages in zip(rows, feedback):
        served = {k: r[k] for k in r.keys() if k not in ("run_id", "data_json")}
        out.append({"id": r["trajectory_id"], "created_at": r["created_at"], "run_id": r["run_id"],
                    "trajectory": json.loads(r["data_json"]), "served": served, "feedback": messages})
    return out, last_feedback


class ChangedSinceRead(RuntimeError):
    """Feedback reached a turn between its export and its deletion; nothing was deleted."""


@locked
def delete_turns(store: Store, ids: list[str], feedback_after: int | None = None) -> int:
    """Delete served turns by trajectory id, in one transaction: their feedback messages, their
    ``served`` rows, their trajectories and reward rows (:meth:`Store.remove_trajectories`). A
    kept turn whose parent goes loses the link (``served.parent_id`` NULL; its trajectory's
    record keeps the id). Returns how many were deleted: ``len(ids)``, or nothing is.

    Args:
        ids: trajectory ids of served turns.
        feedback_after: the ``feedback.id`` the caller read up to (:func:`old_turns`); a newer
            message on one of the turns means its export misses it.

    Raises:
        ChangedSinceRead: a feedback message newer than ``feedback_after`` reached one of them.
        KeyError: an id that is not a served turn.
        sqlite3.OperationalError: the store cannot be written (disk full, locked).
        In each case nothing is deleted.
    """
    with store.conn:
        store.conn.execute("BEGIN IMMEDIATE")  # a replica's feedback comes before the check or after the commit
        pairs = {}
        for tid in ids:
            row = store.conn.execute("SELECT response_id, choice FROM served WHERE trajectory_id = ?",
                                     (tid,)).fetchone()
            if row is None:
                raise KeyError(f"no served turn {tid!r}; nothing deleted")
            pairs[(row[0], row[1])] = tid
        if feedback_after is not None:
            late = [pairs[(r[0], r[1])] for r in store.conn.execute(
                "SELECT response_id, choice FROM feedback WHERE id > ?", (feedback_after,)).fetchall()
                if (r[0], r[1]) in pairs]
            if late:
                raise ChangedSinceRead(f"feedback reached {len(late)} turn(s) after they were read, e.g. {late[0]}; "
                                       "nothing deleted")
        store.conn.executemany("DELETE FROM feedback WHERE response_id = ? AND choice = ?", list(pairs))
        store.conn.executemany("UPDATE served SET parent_id = NULL WHERE parent_id = ?", [(t,) for t in ids])
        store.conn.executemany("DELETE FROM served WHERE trajectory_id = ?", [(t,) for t in ids])
        n = store.remove_trajectories(ids)
        if n != len(ids):
            raise KeyError(f"{n} trajectories found for {len(ids)} served turns; nothing deleted")
    return n

"""Where a feedback value lands among the served turns: on the judged turn and on its earlier
turns of the conversation, a value never replacing one from a stronger source
(:data:`SOURCE_RANK`). :func:`selfrl.record.served.apply_feedback` attaches each message as it
arrives; :mod:`selfrl.record.served_schema` replays them when it takes back the value 0 an older
store gave a comment alone. Callers hold ``store.lock`` and their own transaction."""

from __future__ import annotations

import sqlite3

# A stronger source replaces a weaker one, never the other way round: the user's own
# verdict on a turn beats a verdict on a later turn of the conversation, which beats
# a correction guessed from the next user message.
SOURCE_RANK = {"implicit": 1, "inherited": 2, "explicit": 3}


def chain(conn: sqlite3.Connection, trajectory_id: str, limit: int = 100) -> list[str]:
    """``trajectory_id`` and its ancestors (earlier turns of the conversation), latest first."""
    out, cur = [], trajectory_id
    while cur is not None and len(out) < limit:
        out.append(cur)
        row = conn.execute("SELECT parent_id FROM served WHERE trajectory_id = ?", (cur,)).fetchone()
        cur = None if row is None else row[0]
    return out


def attach(conn: sqlite3.Connection, trajectory_id: str, source: str, value: float,
           only: set[str] | None = None) -> tuple[int, int]:
    """Attach ``value``, from feedback of ``source`` (``explicit`` or ``implicit``) on the turn
    ``trajectory_id``, to it (as ``source``) and its ancestors (``inherited`` for explicit, else
    ``implicit``), but not over a value from a stronger source. ``only``: the turns it may change
    (the others are passed over; None: all). Returns ``(pending, other)``: how many pending turns,
    and how many trained or skipped ones, got the value."""
    changed, late = 0, 0
    for i, tid in enumerate(chain(conn, trajectory_id)):
        if only is not None and tid not in only:
            continue
        src = source if i == 0 else ("inherited" if source == "explicit" else "implicit")
        cur = conn.execute("SELECT feedback_source, status FROM served WHERE trajectory_id = ?", (tid,)).fetchone()
        if cur[0] is not None and SOURCE_RANK[cur[0]] > SOURCE_RANK[src]:
            continue
        conn.execute("UPDATE served SET feedback = ?, feedback_source = ? WHERE trajectory_id = ?", (value, src, tid))
        if cur[1] == "pending":
            changed += 1
        else:
            late += 1
    return changed, late

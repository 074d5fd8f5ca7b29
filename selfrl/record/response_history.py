"""The Responses API's stored conversations (``previous_response_id``): the ``response_history``
table of the server's store (created with the others by :func:`selfrl.record.served.init`),
bounded in rows and bytes, each conversation readable only by the client that made it."""

from __future__ import annotations

import json
import time
from typing import Any

from selfrl.record.served import locked
from selfrl.record.store import Store, to_json


@locked
def remember_response(store: Store, response_id: str, client: str, messages: list[dict[str, Any]],
                      max_items: int, max_bytes: int) -> None:
    """Store the conversation up to and including ``response_id``'s output, for ``client``;
    then forget the oldest ones beyond ``max_items`` rows or ``max_bytes`` of JSON. One
    transaction: a crash keeps all of it or none."""
    data = to_json(messages)
    with store.conn:
        store.conn.execute(
            "INSERT INTO response_history (response_id, client, created_at, bytes, messages_json) VALUES (?, ?, ?, ?, ?)",
            (response_id, client, time.time(), len(data), data))
        store.conn.execute(
            "DELETE FROM response_history WHERE seq <= (SELECT MAX(seq) FROM response_history) - ?", (max_items,))
        total = store.conn.execute("SELECT COALESCE(SUM(bytes), 0) FROM response_history").fetchone()[0]
        if total > max_bytes:  # oldest first, until what is left fits (the newest always stays)
            drop, cut = total - max_bytes, None
            for seq, size in store.conn.execute("SELECT seq, bytes FROM response_history ORDER BY seq"):
                cut, drop = seq, drop - size
                if drop <= 0:
                    break
            store.conn.execute("DELETE FROM response_history WHERE seq <= ? AND response_id != ?", (cut, response_id))


@locked
def recall_response(store: Store, response_id: str, client: str) -> list[dict[str, Any]] | None:
    """The conversation stored for ``response_id`` when ``client`` made it; None when it was
    never stored, was forgotten, or belongs to another client (the same answer, so an id
    reveals nothing about other clients' conversations)."""
    row = store.conn.execute("SELECT messages_json FROM response_history WHERE response_id = ? AND client = ?",
                             (response_id, client)).fetchone()
    return None if row is None else json.loads(row[0])

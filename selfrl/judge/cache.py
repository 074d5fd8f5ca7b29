"""The verdict cache: a judge's score of an answer, kept in SQLite so that the same answer is
not paid for twice (``RUN_DIR/judge_cache.db``; a resumed run keeps it).

A key is the sha256 of the task id, the answer's content hash (``prompt.content_hash``), the
judge (model and base URL), the rubric's version, the mode and whether reasons were asked for;
in group mode also the hash of the whole group's distinct answers, since a relative score
means something only among the answers it was compared with. Calibration answers are never
cached: they exist to be judged afresh.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import time
from pathlib import Path

from selfrl.config.judge import JudgeEndpoint
from selfrl.judge.verdict import Verdict

SCHEMA = """
CREATE TABLE IF NOT EXISTS verdicts (
    key     TEXT PRIMARY KEY,
    judge   TEXT NOT NULL,
    score   REAL NOT NULL,
    reason  TEXT NOT NULL,
    created REAL NOT NULL
);
"""


def verdict_key(endpoint: JudgeEndpoint, task_id: str, answer_hash: str, group_hash: str = "") -> str:
    """The cache key of one answer's verdict (sha256 hex).

    >>> e = JudgeEndpoint(rubric="r")
    >>> verdict_key(e, "t1", "h") == verdict_key(e, "t1", "h"), verdict_key(e, "t1", "h") == verdict_key(e, "t2", "h")
    (True, False)
    """
    parts = [task_id, answer_hash, group_hash, endpoint.model, endpoint.base_url, endpoint.rubric_version,
             endpoint.mode, endpoint.explain]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


class VerdictCache:
    """``{key: Verdict}`` in an SQLite file; thread-safe.

    Args:
        path: the database file (created with its folder); None keeps the cache in memory.
    """

    def __init__(self, path: Path | None):
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.conn = sqlite3.connect(str(path) if path is not None else ":memory:", check_same_thread=False)
        self.conn.executescript(SCHEMA)
        self.lock = threading.Lock()

    def get(self, key: str) -> Verdict | None:
        """The stored verdict, or None."""
        with self.lock:
            row = self.conn.execute("SELECT score, reason FROM verdicts WHERE key = ?", (key,)).fetchone()
        return None if row is None else Verdict(row[0], row[1])

    def put(self, key: str, judge: str, verdict: Verdict) -> None:
        """Store ``verdict`` under ``key`` (a later verdict for the same key replaces it)."""
        with self.lock, self.conn:
            self.conn.execute("INSERT OR REPLACE INTO verdicts VALUES (?, ?, ?, ?, ?)",
                              (key, judge, verdict.score, verdict.reason, time.time()))

    def __len__(self) -> int:
        with self.lock:
            return self.conn.execute("SELECT COUNT(*) FROM verdicts").fetchone()[0]

    def close(self) -> None:
        with self.lock:
            self.conn.close()

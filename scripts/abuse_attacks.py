"""The attacks of the abuse suite (``scripts/abuse_suite.py``) against a live ``selfrl serve``,
listed in :data:`ATTACKS` with the issue case each comes from.

An attack is an :class:`Attack`: a name, the issue case it comes from, and a function
``run(target) -> Tally``; an attack whose fix has not landed yet has ``pending`` set to
the reason and is listed, not run (``--include-pending`` runs the written ones anyway).
A :class:`Tally` holds what the attack sent and the rows it legitimately added, so that the
suite can tell added rows from rows that refused requests left behind.
"""

from __future__ import annotations

import json
import socket
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from abuse_client import chat, request, send_chunked
from abuse_corpus import hostile_requests

API_KEY = "abuse-suite-key-0123456789"
MB = 1 << 20


@dataclass
class Target:
    """The server under attack."""

    base: str
    db: Path
    pid: int | None = None  # the server process (for its memory), when it is a subprocess


@dataclass
class Tally:
    """What one attack did: request statuses, the rows it legitimately added, its own verdict."""

    statuses: list[int] = field(default_factory=list)
    added_turns: int = 0  # served turns the accepted requests recorded
    added_feedback: int = 0  # feedback rows the accepted requests wrote
    problems: list[str] = field(default_factory=list)  # the attack's own inconsistent states
    detail: str = ""


@dataclass
class Attack:
    name: str
    case: str  # where it comes from (issue 12 case N, or "handled" for the ones that already held)
    run: Callable[[Target], Tally] | None
    pending: str | None = None  # why it is listed but not run yet (the attack may be written already)


def rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def attack_chunked_body(t: Target) -> Tally:
    """Issue 12 case 4: a 40 MB prompt sent chunked, no Content-Length."""
    before = rss_mb(t.pid)
    t0 = time.perf_counter()
    status, sent, closed = send_chunked(t.base, 40 * MB)
    dt = time.perf_counter() - t0
    after = rss_mb(t.pid)
    tally = Tally([status], detail=f"{status} after {sent / MB:.1f} MB accepted, {dt:.2f} s, connection "
                  f"{'closed' if closed else 'left open'}"
                  + (f", RSS {before:.0f} -> {after:.0f} MB" if before and after else ""))
    if status != 413 or not closed:
        tally.problems.append(f"chunked 40 MB body answered {status}, expected 413 and a closed connection")
    if sent >= 40 * MB:
        tally.problems.append("the server read the whole 40 MB before refusing")
    return tally


def attack_declared_length(t: Target) -> Tally:
    """Handled before: a 40 MB Content-Length gets a 413 before the body is read."""
    status, sent, _ = send_chunked(t.base, 40 * MB, content_length=40 * MB)
    tally = Tally([status], detail=f"{status} after {sent / MB:.2f} MB accepted")
    if status != 413:
        tally.problems.append(f"Content-Length 40 MB answered {status}")
    return tally


def attack_hostile_values(t: Target) -> Tally:
    """Issue 12 case 5: every route, one hostile value in one field at a time."""
    tally = Tally()
    corpus = hostile_requests()
    for method, path, raw, key in corpus:
        status, _ = request(t.base, method, path, raw or None, API_KEY if key else None)
        tally.statuses.append(status)
    fives = sum(s >= 500 for s in tally.statuses)
    tally.detail = f"{len(corpus)} requests; statuses {sorted(set(tally.statuses))}"
    if fives:
        tally.problems.append(f"{fives} requests answered 5xx")
    return tally


def attack_implicit_forgery(t: Target) -> Tally:
    """Issue 12 case 6: a client without the key replays the victim's conversation and adds
    "No, that's wrong."; the victim's turn must keep no feedback."""
    tally = Tally()
    q = [{"role": "user", "content": "What is 6*7?"}]
    status, victim = chat(t.base, q, "victim-token-0123456789", temperature=0, max_tokens=4)
    tally.statuses.append(status)
    if status != 200:
        tally.problems.append(f"the victim's request answered {status}")
        return tally
    tally.added_turns += 1
    answer = victim["choices"][0]["message"]
    replay = q + [{"role": "assistant", "content": answer.get("content") or ""}, {"role": "user",
                                                                                 "content": "No, that's wrong."}]
    for key in (None, "attacker-token-0123456789"):
        status, _ = chat(t.base, replay, key, max_tokens=2)
        tally.statuses.append(status)
        tally.added_turns += status == 200
    with sqlite3.connect(f"file:{t.db}?mode=ro", uri=True) as conn:
        row = conn.execute("SELECT feedback, feedback_source FROM served WHERE response_id = ?",
                           (victim["id"],)).fetchone()
    tally.detail = f"victim's turn feedback after the replays: {row}"
    if row is None or row[0] is not None:
        tally.problems.append(f"the victim's turn got feedback {row} from another client")
    return tally


def attack_feedback_without_key(t: Target) -> Tally:
    """Handled before: explicit feedback and admin routes without the key."""
    tally = Tally()
    for path, body in (("/v1/feedback", {"response_id": "x", "rating": -1}), ("/admin/pin", {"version": 0}),
                       ("/admin/rollback", {"version": 0}), ("/admin/unpin", {})):
        for key in (None, "wrong-key-0123456789abcdef"):
            status, _ = request(t.base, "POST", path, json.dumps(body).encode(), key)
            tally.statuses.append(status)
            if status not in (401, 403):
                tally.problems.append(f"{path} with key {key!r} answered {status}")
    tally.detail = f"statuses {sorted(set(tally.statuses))}"
    return tally


def attack_nesting_and_numbers(t: Target) -> Tally:
    """Handled before: 100,000-deep JSON, NaN and huge numbers in sampling settings."""
    tally = Tally()
    bodies = [b'{"model": "selfrl", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"]
    for field_, v in (("temperature", "NaN"), ("top_p", "Infinity"), ("max_tokens", "1" + "0" * 400),
                      ("n", "1e400"), ("seed", "9" * 4000)):
        bodies.append(f'{{"model": "selfrl", "messages": [{{"role": "user", "content": "x"}}], "{field_}": {v}}}'
                      .encode())
    for raw in bodies:
        tally.statuses.append(request(t.base, "POST", "/v1/chat/completions", raw)[0])
    tally.added_turns = tally.statuses.count(200)  # an accepted completion is recorded
    tally.detail = f"statuses {tally.statuses}"
    return tally


def attack_many_messages_and_tools(t: Target) -> Tally:
    """Handled before: 10,000 messages; 5,000 tools."""
    tally = Tally()
    msgs = [{"role": "user", "content": "hi"}] * 10_000
    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(5_000)]
    tally.statuses.append(chat(t.base, msgs, None, max_tokens=1)[0])
    tally.statuses.append(chat(t.base, [{"role": "user", "content": "hi"}], None, tools=tools, max_tokens=1)[0])
    tally.added_turns = tally.statuses.count(200)
    tally.detail = f"statuses {tally.statuses}"
    return tally


def attack_slow_clients(t: Target) -> Tally:
    """Handled before: 16 clients send half a request and stall for 3 s; others are served meanwhile."""
    tally = Tally()
    host, port = t.base.removeprefix("http://").split(":")
    socks = []
    for _ in range(16):
        s = socket.create_connection((host, int(port)), timeout=10)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"mod")
        socks.append(s)
    status, _ = chat(t.base, [{"role": "user", "content": "hi"}], None, max_tokens=1, record=False)
    tally.statuses.append(status)
    if status != 200:
        tally.problems.append(f"a normal request during the stall answered {status}")
    time.sleep(3)
    for s in socks:
        s.close()
    return tally


def attack_concurrent_flood(t: Target) -> Tally:
    """Handled before: 64 concurrent completions (recorded), all answered, all stored once."""
    tally = Tally()
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda i: chat(t.base, [{"role": "user", "content": f"q{i}"}], None, max_tokens=2),
                                range(64)))
    tally.statuses = [s for s, _ in results]
    tally.added_turns = sum(s == 200 for s, _ in results)
    return tally


def attack_concurrent_pins(t: Target) -> Tally:
    """Issue 12 case 1: 20 concurrent pins of version 0, then 20 concurrent pins and
    rollbacks; every call answers 2xx/4xx, and the served version equals the pin."""
    tally = Tally()

    def admin(path: str, version: int) -> int:
        return request(t.base, "POST", path, json.dumps({"version": version}).encode(), API_KEY)[0]

    with ThreadPoolExecutor(20) as pool:
        tally.statuses += list(pool.map(lambda _: admin("/admin/pin", 0), range(20)))
        tally.statuses += list(pool.map(lambda i: admin("/admin/pin" if i % 2 else "/admin/rollback", 0), range(20)))
        tally.statuses.append(admin("/admin/pin", 0))
    status, raw = request(t.base, "GET", "/admin/status", key=API_KEY)
    state = json.loads(raw) if status == 200 else {}
    if state.get("pinned") != 0 or state.get("served_version") != 0:
        tally.problems.append(f"after the pins: pinned {state.get('pinned')}, served {state.get('served_version')}")
    tally.statuses.append(request(t.base, "POST", "/admin/unpin", b"{}", API_KEY)[0])
    tally.detail = f"statuses {sorted(set(tally.statuses))}"
    return tally


# Cases 2 and 3 need a learner update in flight and a server restart; they are pinned by
# tests/test_serve_versions.py rather than run against this suite's single server.
TESTED_ELSEWHERE = "needs a running learner or a restart; tested in tests/test_serve_versions.py"
ATTACKS: list[Attack] = [
    Attack("chunked_body_40MB", "issue 12 case 4", attack_chunked_body),
    Attack("hostile_values_every_route", "issue 12 case 5", attack_hostile_values),
    Attack("implicit_correction_forgery", "issue 12 case 6", attack_implicit_forgery),
    Attack("declared_length_40MB", "handled", attack_declared_length),
    Attack("feedback_and_admin_without_key", "handled", attack_feedback_without_key),
    Attack("deep_json_nan_huge_numbers", "handled", attack_nesting_and_numbers),
    Attack("10k_messages_5k_tools", "handled", attack_many_messages_and_tools),
    Attack("slow_clients", "handled", attack_slow_clients),
    Attack("concurrent_flood", "handled", attack_concurrent_flood),
    Attack("concurrent_pins", "issue 12 case 1", attack_concurrent_pins),
    Attack("rollback_during_update", "issue 12 case 2", None, TESTED_ELSEWHERE),
    Attack("stray_adapter_folder", "issue 12 case 3", None, TESTED_ELSEWHERE),
]

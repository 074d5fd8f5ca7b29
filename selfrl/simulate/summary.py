"""What the simulator sent and what it saw, summed up from its event log (``summary.json``).

Every field is counted from the events (``events.jsonl``, one JSON object a line), so the
summary can be rebuilt from the log alone:

* ``request`` events: one per HTTP request, with its ``route`` (chat, feedback), ``purpose``
  (turn, correction_turn, rating, correction, hostile:<action>), ``status`` (0: no answer), real
  ``latency_s``, its ``response_id`` (and the adapter ``version`` that answered a completion)
  and, for feedback, the ``rating`` or ``corrected`` it sent and the server's ``outcome`` (``used``,
  ``queued`` or ``too_old``: what the age rule made of it);
* ``outcome``: a conversation's final answer, the verifier's verdict on it (``correct``) and the
  adapter ``version`` that gave it;
* ``judgement``: an honest user's verdict, reaction and its delay;
* ``hostile``: a hostile user's action;
* ``stop``: why the loop ended (``reason``; ``interrupted`` with the ``signal`` after Ctrl-C).

``t_sim`` and ``t_real`` on every event are simulated and real seconds from the start.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from typing import Any

DELAY_BUCKETS = ((60.0, "<1m"), (3600.0, "1m-1h"), (86400.0, "1h-1d"), (math.inf, ">=1d"))


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-quantile (0-1) by the nearest rank, None for no values.

    >>> percentile([3.0, 1.0, 2.0, 4.0], 0.5), percentile([1.0, 2.0], 0.95), percentile([], 0.5)
    (2.0, 2.0, None)
    """
    if not values:
        return None
    s = sorted(values)
    return s[max(0, math.ceil(q * len(s)) - 1)]


def delay_bucket(seconds: float) -> str:
    """The histogram bucket of a delay: <1m, 1m-1h, 1h-1d, >=1d."""
    return next(name for bound, name in DELAY_BUCKETS if seconds < bound)


def _nested(counter_of_pairs: Counter) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = defaultdict(dict)
    for (a, b), n in sorted(counter_of_pairs.items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1]))):
        out[str(a)][str(b)] = n
    return dict(out)


def summarize(events: list[dict[str, Any]], cfg, stopped: str, pending: int, signal: str | None = None) -> dict[str, Any]:
    """The summary of ``events`` (see the module docstring) under config ``cfg``.

    Args:
        stopped: what ended the loop: done, max_requests, max_seconds or interrupted.
        signal: the signal that interrupted it (``SIGINT``: Ctrl-C), else None.

    Returns:
        ``{seed, stopped_by, signal, sim_seconds, real_seconds, requests, conversations, feedback,
        hostile, http, success, latency_s}``; ``success[family]`` is a list of windows of
        ``cfg.window_s`` simulated seconds (by the conversation's start), each ``{window,
        start_s, n, correct, success}``.
    """
    reqs = [e for e in events if e["event"] == "request"]
    outcomes = [e for e in events if e["event"] == "outcome"]
    judgements = [e for e in events if e["event"] == "judgement"]
    hostile = [e for e in events if e["event"] == "hostile"]
    chat = [e for e in reqs if e["route"] == "chat"]
    asked = [e for e in chat if not e["purpose"].startswith("hostile:")]
    by_route = Counter((e["route"], e["status"]) for e in reqs)
    windows: dict[tuple[str, int], list[bool]] = defaultdict(list)
    for e in outcomes:
        if e["served"]:
            windows[(e["family"], int(e["start_s"] // cfg.window_s))].append(bool(e["correct"]))
    success: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for (family, w), verdicts in sorted(windows.items()):
        success[family].append({"window": w, "start_s": w * cfg.window_s, "n": len(verdicts),
                                "correct": sum(verdicts), "success": round(sum(verdicts) / len(verdicts), 4)})
    reacting = [e for e in judgements if e["reaction"] != "silence"]
    latencies = [e["latency_s"] for e in chat if e["status"] == 200]
    return {
        "seed": cfg.seed,
        "stopped_by": stopped,
        "signal": signal,
        "sim_seconds": events[-1]["t_sim"] if events else 0.0,
        "real_seconds": events[-1]["t_real"] if events else 0.0,
        "requests": {
            "total": len(reqs), "chat": len(chat), "feedback": len(reqs) - len(chat),
            "chat_by_family_phase": _nested(Counter((e["family"], e["phase"]) for e in chat)),
            "by_purpose": dict(sorted(Counter(e["purpose"] for e in reqs).items())),
        },
        "conversations": {
            "served": sum(e["served"] for e in outcomes), "failed": sum(not e["served"] for e in outcomes),
            "by_family_phase": _nested(Counter((e["family"], e["phase"]) for e in outcomes)),
        },
        "feedback": {
            "reactions": dict(sorted(Counter(e["reaction"] for e in judgements).items())),
            "misjudged": sum(e["misjudged"] for e in judgements),
            "delays": {name: sum(delay_bucket(e["delay_s"]) == name for e in reacting) for _, name in DELAY_BUCKETS},
            "sent_by_status": _nested(Counter((e["purpose"], e["status"]) for e in reqs
                                              if e["purpose"] in ("rating", "correction", "correction_turn"))),
            "pending": pending,
            "outcomes": dict(sorted(Counter(e["outcome"] for e in reqs if "outcome" in e).items())),
        },
        "hostile": {
            "users": len({e["user"] for e in hostile}),
            "actions": dict(sorted(Counter(e["action"] for e in hostile).items())),
            "status": _nested(Counter((e["purpose"].removeprefix("hostile:"), e["status"]) for e in reqs
                                      if e["purpose"].startswith("hostile:"))),
        },
        "http": {
            "chat": {str(s): n for (r, s), n in sorted(by_route.items()) if r == "chat"},
            "feedback": {str(s): n for (r, s), n in sorted(by_route.items()) if r == "feedback"},
            "server_errors": sum(1 for e in reqs if e["status"] == 0 or e["status"] >= 500),
            # completions of ordinary (not hostile) users answered with no 2xx, of how many were sent
            "failed_completions": sum(1 for e in asked if not 200 <= e["status"] < 300),
            "completions_asked": len(asked),
        },
        "success": dict(success),
        "latency_s": {"n": len(latencies), "p50": percentile(latencies, 0.5), "p95": percentile(latencies, 0.95)},
    }

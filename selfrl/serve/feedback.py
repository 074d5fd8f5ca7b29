"""Turning what users do into rewards: explicit feedback, implicit corrections,
conversation links, and the reward of a served turn.

**Explicit feedback** (``POST /v1/feedback``) gives a value in [-1, 1]: the rating
when one is given, else -1 when the user corrected the answer (``corrected: true``, or a
message that carries a correction: ``correction`` text or ``correction_tool_calls``). A
message with neither (a ``comment`` alone) judges nothing: it is stored with the turn, and
the turn keeps the value it had, or stays without one (:func:`explicit_value` is None; a
comment never makes a turn trainable with reward 0).

**Implicit correction.** When a conversation comes back with a new *user* message
right after our answer, that message is read as a correction
(:func:`selfrl.envs.rewards.correction_reason`, the rule of the ``user_correction`` reward) when

1. it opens with a correction phrase (:data:`CORRECTION_RE`: "no", "wrong",
   "that's not right", "try again", "actually", ...), or
2. it repeats the user's previous request: after lower-casing and collapsing
   whitespace, ``difflib.SequenceMatcher`` similarity >= :data:`REPEAT_SIMILARITY`.

Limits of the rule, on purpose kept simple and visible: it reads English only; a user
who says "no, that's great, now do X" is counted as a correction; a user who silently
gives up or rephrases with other words is not; and it only sees conversations whose
client sends the earlier turns back unchanged (OpenAI-style clients do). An implicit
correction counts -1 and never overrides explicit feedback.

**Linking.** A request continues an earlier served turn when its messages, up to its
last assistant message, equal that turn's request messages plus the answer we
returned (compared by role, text, and tool-call names and arguments; tool-call ids
are ignored): see :func:`conversation_key`, *and* it comes from the same client.

**Who is the same client.** A client is the bearer token it sends
(``Authorization: Bearer <token>``; the OpenAI clients always send one), kept as a
hash (:func:`client_identity`) with each served turn. A request links to, inherits the
group of, and may implicitly correct only the turns recorded for its own identity;
another client cannot forge one without knowing the token. A request without a bearer
token is anonymous: it is recorded, but it never continues an earlier turn, so its
next message is never read as a correction of anyone's answer. Clients that share one
token (one key for a whole application, or ``--protect-completions``) are one client
under this rule: give each end user its own token to keep them apart. Explicit
feedback (``POST /v1/feedback``) needs the server's API key.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from collections import defaultdict

from selfrl.core.tasks import Task, TaskSource
from selfrl.core.trajectory import Trajectory
from selfrl.envs.rewards import CORRECTION_RE, REPEAT_SIMILARITY, correction_reason  # noqa: F401  (the rule)
from selfrl.envs.rewards import score_group


def explicit_value(rating: float | None, corrected: bool) -> float | None:
    """The reward value of explicit feedback (see the module docstring): None when the message
    judges nothing (no rating, not corrected). ``corrected``: the message's ``corrected`` or the
    correction it carries (:attr:`selfrl.serve.feedback_request.FeedbackRequest.is_corrected`).

    >>> explicit_value(0.5, True), explicit_value(None, True), explicit_value(None, False)
    (0.5, -1.0, None)
    """
    if rating is not None:
        return float(rating)
    return -1.0 if corrected else None


def _canonical(messages: list[dict[str, Any]]) -> list[Any]:
    out = []
    for m in messages:
        calls = []
        for c in m.get("tool_calls") or []:
            fn = c.get("function", {})
            try:
                args = json.loads(fn.get("arguments") or "{}")
            except (json.JSONDecodeError, TypeError):
                args = fn.get("arguments")
            calls.append([fn.get("name"), args])
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        out.append([m.get("role"), (content or "").strip(), calls])
    return out


def conversation_key(messages: list[dict[str, Any]]) -> str:
    """A hash of OpenAI-style messages for linking turns (tool-call ids ignored).

    >>> a = [{"role": "user", "content": "hi "}, {"role": "assistant", "content": None,
    ...       "tool_calls": [{"id": "call_1", "function": {"name": "f", "arguments": '{"x": 1}'}}]}]
    >>> b = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "",
    ...       "tool_calls": [{"id": "call_9", "function": {"name": "f", "arguments": '{ "x":1 }'}}]}]
    >>> conversation_key(a) == conversation_key(b)
    True
    """
    blob = json.dumps(_canonical(messages), sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()


def client_identity(authorization: str | None) -> str:
    """The client identity of a request: a hash of its bearer token, "" when it has none.

    >>> client_identity(None), client_identity("Basic abc")
    ('', '')
    >>> client_identity("Bearer sk-1") == client_identity("bearer  sk-1 ") != client_identity("Bearer sk-2")
    True
    """
    header = (authorization or "").strip()
    if not header.lower().startswith("bearer "):
        return ""
    token = header[7:].strip()
    return "" if not token else "bearer:" + hashlib.sha256(token.encode("utf-8", "replace")).hexdigest()[:32]


def default_group_key(messages: list[dict[str, Any]]) -> str:
    """The learner's group of a request without ``task_key``: its first user message."""
    first = next((m for m in _canonical(messages) if m[0] == "user"), ["user", "", []])
    return "prompt:" + hashlib.sha256(first[1].encode()).hexdigest()[:16]


def served_rewards(feedback: float | None, tool_success: float | None,
                   weights: dict[str, float]) -> tuple[dict[str, float | None], float | None]:
    """Reward breakdown and total of a served turn.

    Components: ``user_feedback`` (explicit, inherited or implicit feedback, in
    [-1, 1]; None when none arrived) and ``tool_success`` (share of the turn's tool
    calls that parsed, named a requested tool and matched its schema; None without
    calls). The total is the weighted sum of the components that apply, and None when
    none applies (such a turn is not trained on).

    >>> served_rewards(-1.0, 1.0, {"user_feedback": 1.0, "tool_success": 0.2})
    ({'user_feedback': -1.0, 'tool_success': 1.0}, -0.8)
    >>> served_rewards(None, None, {"user_feedback": 1.0, "tool_success": 0.2})
    ({'user_feedback': None, 'tool_success': None}, None)
    """
    parts = {"user_feedback": feedback, "tool_success": tool_success}
    applied = [(weights.get(k, 0.0), v) for k, v in parts.items() if v is not None and weights.get(k, 0.0) != 0.0]
    total = round(sum(w * v for w, v in applied), 12) if applied else None
    return parts, total


class ServedTraffic(TaskSource):
    """The task source of served turns: a group's task has no reference answer (its
    verdict is the users' feedback, the ``user_feedback`` reward), so nothing scores as correct."""

    name = "served"

    def sample(self, n: int, seed: int) -> list[Task]:
        raise NotImplementedError("served turns come from clients; there is nothing to sample")

    def score(self, task: Task, answer: str | None) -> float:
        return 0.0


SERVED = ServedTraffic()


def served_task(task_id: str, feedback: dict[str, float | None]) -> Task:
    """The task of served turns ``task_id`` (their group key), holding each turn's feedback
    ``{trajectory id: value or None}`` for the ``user_feedback`` reward."""
    return Task(task_id, "served", "", "", {"feedback": dict(feedback)})


def score_served(batch: list[tuple[Trajectory, dict]], weights: dict[str, float]) -> tuple[list[Trajectory],
                                                                                         list[Trajectory]]:
    """Rewards of served turns through :func:`selfrl.envs.rewards.score_group` (the ``user_feedback``
    reward reads the feedback each turn's ``served`` row holds); ``group_id`` becomes the row's
    group key. Returns (scored, left out because no reward component applied)."""
    by_task: dict[str, list[Trajectory]] = defaultdict(list)
    feedback: dict[str, dict[str, float | None]] = defaultdict(dict)
    for traj, row in batch:
        traj.group_id = row["group_key"]
        by_task[traj.task_id].append(traj)
        feedback[traj.task_id][traj.id] = row["feedback"]
    for task_id, trajs in by_task.items():
        score_group(trajs, served_task(task_id, feedback[task_id]), SERVED, weights)
    scored, unscored = [], []
    for traj, _ in batch:
        traj.correct = None  # served turns have no reference answer
        if traj.reward is None or all(v is None for v in traj.rewards.values()):
            traj.reward = None
            unscored.append(traj)
        else:
            scored.append(traj)
    return scored, unscored

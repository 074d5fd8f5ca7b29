"""A judge's answer, read strictly: the JSON schemas asked for, the parsers, and the failure.

A judge scores on an integer scale of 0 to ``MAX_SCORE``; the reward is that score divided
by ``MAX_SCORE``, in [0, 1]. Integers, because small judges grade more steadily on a short
integer scale than on a float, and a grammar keeps them to it.

The answer must be one JSON object and nothing else (surrounding whitespace and one
```` ```json ```` fence around the whole answer are allowed); no number is fished out of
free text. Anything else raises :class:`JudgeFailure`, which the reward records on the
trajectory and leaves out of the update (``selfrl.envs.rewards.score_group``): a verdict that
cannot be read is never a 0.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

MAX_SCORE = 10
REASON_CHARS = 200  # longest reason the schema allows


class JudgeFailure(RuntimeError):
    """No usable verdict: the endpoint failed or timed out on every try, refused the request,
    answered something unreadable, or failed calibration; the message says which."""


@dataclass(frozen=True)
class Verdict:
    """One judged answer: ``score`` in [0, 1] (the judge's integer / ``MAX_SCORE``) and its reason."""

    score: float
    reason: str = ""


def _item_schema(explain: bool) -> dict[str, Any]:
    props: dict[str, Any] = {"score": {"type": "integer", "minimum": 0, "maximum": MAX_SCORE}}
    if explain:  # the reason first, so that the score follows from it
        props = {"reason": {"type": "string", "maxLength": REASON_CHARS}, **props}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def pointwise_schema(explain: bool) -> dict[str, Any]:
    """The JSON schema of a pointwise verdict: ``{"reason": str, "score": 0..10}`` (no reason
    without ``explain``).

    >>> pointwise_schema(False)["required"]
    ['score']
    """
    return _item_schema(explain)


def group_schema(ids: list[str], explain: bool) -> dict[str, Any]:
    """The JSON schema of a group verdict: one key per candidate id, each a pointwise verdict.

    >>> sorted(group_schema(["c1", "c2"], False)["properties"])
    ['c1', 'c2']
    """
    return {"type": "object", "properties": {i: _item_schema(explain) for i in ids}, "required": list(ids),
            "additionalProperties": False}


_FENCE = re.compile(r"\A```(?:json)?\s*\n?(.*?)\n?```\Z", re.DOTALL)


def load_object(text: str) -> dict[str, Any]:
    """The JSON object that is the whole of ``text`` (one ```` ```json ```` fence allowed).

    Raises:
        JudgeFailure: not a JSON object.

    >>> load_object('```json\\n{"score": 7}\\n```')
    {'score': 7}
    >>> load_object('Score: 7')
    Traceback (most recent call last):
    ...
    selfrl.judge.verdict.JudgeFailure: unreadable verdict (not one JSON object): 'Score: 7'
    """
    stripped = (text or "").strip()
    fenced = _FENCE.match(stripped)
    body = fenced.group(1) if fenced else stripped
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise JudgeFailure(f"unreadable verdict (not one JSON object): {stripped[:120]!r}")
    return data


def read_item(item: Any, explain: bool, where: str = "") -> Verdict:
    """One ``{"reason", "score"}`` object as a :class:`Verdict`.

    Raises:
        JudgeFailure: not an object, a missing or extra key, a score that is not a number in
            [0, ``MAX_SCORE``], or a reason that is not a string.
    """
    if not isinstance(item, dict):
        raise JudgeFailure(f"unreadable verdict{where}: expected an object, got {item!r}"[:200])
    expected = {"reason", "score"} if explain else {"score"}
    if set(item) != expected:
        raise JudgeFailure(f"unreadable verdict{where}: keys {sorted(item)}, expected {sorted(expected)}")
    score = item["score"]
    if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score) \
            or not 0 <= score <= MAX_SCORE:
        raise JudgeFailure(f"unreadable verdict{where}: score {score!r} is not a number in [0, {MAX_SCORE}]")
    reason = item.get("reason", "")
    if not isinstance(reason, str):
        raise JudgeFailure(f"unreadable verdict{where}: reason {reason!r} is not a string")
    return Verdict(score / MAX_SCORE, reason)


def parse_pointwise(text: str, explain: bool) -> Verdict:
    """A pointwise answer as a :class:`Verdict`.

    Raises:
        JudgeFailure: as :func:`load_object` and :func:`read_item`.

    >>> parse_pointwise('{"reason": "right sum", "score": 8}', explain=True)
    Verdict(score=0.8, reason='right sum')
    """
    return read_item(load_object(text), explain)


def parse_group(text: str, ids: list[str], explain: bool) -> dict[str, Verdict]:
    """A group answer as ``{candidate id: Verdict}``, every id exactly once.

    Raises:
        JudgeFailure: as :func:`load_object`, a missing or unknown id, or a bad item.

    >>> parse_group('{"c1": {"score": 2}, "c2": {"score": 9}}', ["c1", "c2"], explain=False)["c2"].score
    0.9
    """
    data = load_object(text)
    if set(data) != set(ids):
        missing, extra = sorted(set(ids) - set(data)), sorted(set(data) - set(ids))
        raise JudgeFailure(f"unreadable verdict: candidate ids missing {missing}, unknown {extra}")
    return {i: read_item(data[i], explain, f" for {i}") for i in ids}

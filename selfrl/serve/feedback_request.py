"""``POST /v1/feedback``'s body: a user's verdict on a served response, checked as it arrives
(what it becomes is :mod:`selfrl.serve.feedback`'s and :mod:`selfrl.serve.corrections`')."""

from __future__ import annotations

import math
from typing import Any

from pydantic import Field, field_validator, model_validator

from selfrl.serve.errors import refuse
from selfrl.serve.protocol import FunctionCall, _Strict


class FeedbackRequest(_Strict):
    """``POST /v1/feedback`` body: a user's verdict on a response, possibly minutes later.

    ``rating`` is in [-1, 1] (thumbs down -1, up +1); ``corrected=True`` means the
    user had to correct the answer (counts as -1 unless a rating is given);
    ``correction`` is the corrected answer, stored with the trajectory; ``correction_tool_calls``
    the calls the answer should have made (``[{"name", "arguments": "<JSON object>"}]``, the
    ``function`` of an OpenAI tool call, or the whole tool call: ``{"id", "type", "function"}``).
    A message that carries a correction (text other than blank space, or calls) is a corrected
    one, ``corrected`` left out (:attr:`is_corrected`). With
    ``learner.learn_from_corrections`` (``"calls"``: only those with calls; ``"all"``) a correction
    that carries either trains as a demonstration (:mod:`selfrl.serve.corrections`). ``comment``
    is stored with the turn; a comment alone judges nothing (:func:`selfrl.serve.feedback.explicit_value`).
    ``choice`` picks one of ``n`` choices (default 0).

    Raises (each a 400 naming the field):
        pydantic.ValidationError: a message that says nothing (no rating, no ``corrected: true``, no
            correction, no comment but blank space); ``corrected: false`` with a correction.
    """

    response_id: str = Field(min_length=1, max_length=100)
    choice: int = Field(default=0, ge=0, le=15)
    rating: float | None = Field(default=None, ge=-1.0, le=1.0)
    corrected: bool = False
    correction: str | None = Field(default=None, max_length=20000)
    correction_tool_calls: list[FunctionCall] | None = Field(default=None, max_length=16)
    comment: str | None = Field(default=None, max_length=20000)

    @field_validator("correction_tool_calls", mode="before")
    @classmethod
    def _openai_shape(cls, v: Any) -> Any:
        """A call in OpenAI's tool-call shape (``{"id", "type": "function", "function": {...}}``, as
        ``message.tool_calls`` dumps it) is taken as its ``function``; the id and type say nothing of the answer."""
        if not isinstance(v, list):
            return v
        return [c["function"] if isinstance(c, dict) and "function" in c and set(c) <= {"id", "type", "function"}
                and c.get("type", "function") == "function" else c for c in v]

    @field_validator("correction_tool_calls")
    @classmethod
    def _named(cls, v: list[FunctionCall] | None) -> list[FunctionCall] | None:
        """Each call names a tool: a call of no name is no answer."""
        for i, call in enumerate(v or []):
            if not call.name.strip():
                raise ValueError(f"correction_tool_calls[{i}].name is empty: name the tool the answer should "
                                 "have called")
        return v

    @property
    def carries_correction(self) -> bool:
        """Whether the message says what the answer should have been: ``correction`` text other
        than blank space, or at least one of ``correction_tool_calls``."""
        return bool((self.correction or "").strip() or self.correction_tool_calls)

    @property
    def is_corrected(self) -> bool:
        """``corrected``, or a message that carries a correction."""
        return self.corrected or self.carries_correction

    @model_validator(mode="after")
    def _says_something(self) -> "FeedbackRequest":
        if "corrected" in self.model_fields_set and not self.corrected and self.carries_correction:
            raise refuse("corrected is false, but the message carries a correction (correction or "
                         "correction_tool_calls), which says the answer was wrong: leave corrected out or "
                         "set it to true", "corrected")
        if self.rating is None and not self.is_corrected and not (self.comment or "").strip():
            raise refuse("the feedback says nothing: give a rating in [-1, 1], corrected: true, a correction "
                         "(correction or correction_tool_calls), or a comment")
        return self

    @field_validator("rating", mode="before")
    @classmethod
    def _finite(cls, v):
        """NaN and infinity (JSON ``NaN``, ``Infinity`` or the strings) are named as what they are,
        and a number out of range with the range and its meaning (not pydantic's bound alone)."""
        if isinstance(v, bool):  # pydantic would take true as 1.0: a client's flag is not a rating
            raise ValueError(f"rating must be a number in [-1, 1], got the boolean {str(v).lower()}")
        try:
            x = float(v) if isinstance(v, (int, float, str)) else None
        except ValueError:
            return v  # not a number at all: pydantic's own message says so
        if x is not None and not math.isfinite(x):
            raise ValueError(f"rating must be a finite number in [-1, 1], got {v!r}")
        if x is not None and not -1.0 <= x <= 1.0:
            raise ValueError(f"rating must be in [-1, 1] (-1 thumbs down, +1 thumbs up; scale other "
                             f"ratings into it), got {v!r}")
        return v

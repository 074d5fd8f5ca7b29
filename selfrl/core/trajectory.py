"""The typed trajectory record: one rollout of the agent on one task.

A trajectory holds everything needed to train on it later without re-tokenizing
anything: the exact token ids that went through the model, which of them the
policy sampled (``completion_mask``), and the log-probability of each sampled
token under the sampling distribution (``logprobs``). It also carries what a
person wants to read (messages, tool calls and their results, the final answer)
and what the run needs for accounting (adapter version, timings, token counts).

Shapes are lists because a trajectory is stored row by row; ``selfrl.rl.batch``
turns a list of them into padded tensors.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolCallRecord:
    """One tool call the policy tried to make, as parsed from its text.

    Attributes:
        name: tool name as written by the model ("" when it could not be parsed).
        arguments: parsed JSON arguments (empty when parsing failed).
        raw: the exact text between the tool-call tags.
        ok: True when the call parsed, named a known tool, matched its schema and ran.
        result: the text sent back to the model (the tool's output, or the error).
        error: why the call failed, or None.
    """

    name: str
    arguments: dict[str, Any]
    raw: str
    ok: bool
    result: str
    error: str | None = None


@dataclass
class Trajectory:
    """One multi-turn rollout.

    Token-level fields all have the same length ``T`` (the whole sequence,
    prompt included):

    * ``token_ids`` (T,) int: exact ids fed to / sampled from the model.
    * ``completion_mask`` (T,) 0/1: 1 exactly on tokens the policy sampled
      (every assistant turn, its EOS included); 0 on the prompt and tool output.
    * ``logprobs`` (T,) float: log-probability of each sampled token under the
      sampling distribution (logits / temperature); 0.0 where the mask is 0.

    Attributes:
        task_id: id of the task this rollout solved.
        group_id: rollouts of the same task in the same iteration share it.
        adapter_version: the adapter version whose weights produced the tokens
            (0 means the base model / the starting adapter).
        messages: the chat as OpenAI-style dicts (roles system/user/assistant/tool).
        tool_calls: every tool call attempted, in order.
        final_answer: the assistant's last text with tool calls removed, or None.
        truncated: True when a turn hit the per-turn token limit without EOS, or when the
            next turn would not fit in the model's context (the trajectory ended there).
        rewards: reward breakdown ``{name: value or None}``; ``reward`` is the weighted sum.
        correct: verifier verdict (kept for accounting even when not rewarded).
        error: an exception text when the rollout failed; such a trajectory is
            left out of the update and counted, never scored 0 in silence.
        timings: seconds spent, e.g. ``{"generate": 1.2, "tools": 0.01}``.
        flags: reward-hacking verdicts ``{detector name: reason}``; empty when no
            detector flagged it (see ``selfrl.safety.detectors``).
        env_state: JSON summary of a stateful environment's final state (e.g. the
            web shop's order), what its task source scores; None without one.
        reward_details: what a reward function recorded beside its value, by reward name,
            e.g. ``{"judge": {"judges": {"smol": {"model": ..., "rubric_version": ..., "score": ...}}}}``
            (``selfrl.judge``); empty when none did.
        constraints: the turns sampled under a grammar (``rollout.constrain``), each
            ``{"start", "end", "kind", "grammar"}``: ``token_ids[start:end]`` was sampled
            under the llguidance ``grammar``; the learner replays its masks
            (``selfrl.chat.constrain.replay_masks``). Empty when nothing was constrained.
    """

    task_id: str
    group_id: str
    adapter_version: int
    prompt_len: int = 0
    token_ids: list[int] = field(default_factory=list)
    completion_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    final_answer: str | None = None
    truncated: bool = False
    num_turns: int = 0
    rewards: dict[str, float | None] = field(default_factory=dict)
    reward: float | None = None
    advantage: float | None = None
    correct: bool | None = None
    error: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    flags: dict[str, str] = field(default_factory=dict)
    env_state: dict[str, Any] | None = None
    constraints: list[dict[str, Any]] = field(default_factory=list)
    reward_details: dict[str, Any] = field(default_factory=dict)
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    parent_id: str | None = None

    @property
    def num_completion_tokens(self) -> int:
        """Number of policy-sampled tokens (sum of ``completion_mask``)."""
        return int(sum(self.completion_mask))

    @property
    def tool_success_rate(self) -> float | None:
        """Share of tool calls that succeeded, or None when no tool was called."""
        if not self.tool_calls:
            return None
        return sum(c.ok for c in self.tool_calls) / len(self.tool_calls)

    def check(self) -> None:
        """Raise ValueError when the token-level fields disagree in length."""
        n = len(self.token_ids)
        if len(self.completion_mask) != n or len(self.logprobs) != n:
            raise ValueError(
                f"trajectory {self.id}: token_ids ({n}), completion_mask "
                f"({len(self.completion_mask)}) and logprobs ({len(self.logprobs)}) differ in length"
            )

    @property
    def wrote_a_call(self) -> bool:
        """A tool call was dispatched, or written in the last assistant turn (a call written on
        the last allowed turn is parsed, scored and never dispatched: ``max_turns = 1``).
        The one rule behind every "tool use" rate (iteration line, pre-flight check)."""
        if self.tool_calls:
            return True
        last = next((m.get("content") or "" for m in reversed(self.messages) if m.get("role") == "assistant"), "")
        return "<tool_call>" in last

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form (the store keeps this)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Trajectory":
        """Inverse of :meth:`to_dict`."""
        d = dict(d)
        d["tool_calls"] = [ToolCallRecord(**c) for c in d.get("tool_calls", [])]
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

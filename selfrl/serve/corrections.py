"""Corrections as demonstrations: what a user said the answer should have been, trained beside
the turn it corrects (``learner.learn_from_corrections``).

A rating says only whether a turn was right. A correction that carries the right answer
(``POST /v1/feedback`` with ``correction`` text and/or ``correction_tool_calls``) says what
to do instead; with the setting on, the learner turns it into one more trajectory of the
update (:func:`demonstrations`):

* **Tokens.** The corrected turn's own prompt ids, then the assistant message ``{content:
  text + each call in the model's call format}`` as the chat template renders it after them
  (:func:`completion_ids`), up to and including the first end-of-turn token; for a turn
  decoded under a grammar, its JSON compact, as the grammar samples it. So the
  demonstration is the answer the served model would have had to sample, in the exact
  context the user saw.
* **Reward and group.** The reward of an answer its user judged right (``user_feedback`` +1,
  and ``tool_success`` 1 when it makes calls, weighted by ``learner.reward_weights``), in its
  turn's group (its ``group_key``): it raises the group's mean, so the wrong answers beside
  it are pushed down harder, and its own advantage is positive.
* **Loss.** The same clipped loss as every turn. Its behaviour log-probs are the learner's
  own (the learner recomputes them for every turn before an update), so its ratio is 1 and
  its gradient is ``advantage x grad log pi(demonstration)``: supervised learning on the
  correction, weighted by how much better it is than its group. It is decoded without the
  turn's grammar (none sampled it), and it carries the version the learner holds, so the age
  rule gives it weight 1. This is the mixed-policy group of LUFFY (Yan et al., 2025,
  "Learning to Reason under Off-Policy Guidance", arXiv:2504.14945), without its policy shaping.

A correction is left out (``skip`` reasons, counted by the update) when it cannot be the
turn's answer: the turn was decoded under a tool-call grammar (``tool_choice: "required"``)
and the correction has no calls, or under a JSON grammar (``response_format``) and it is not
JSON; the template does not render the message after the
generation prompt; the demonstration is longer than ``max_completion_length``; or it has no
end-of-turn token. One demonstration per turn, from its newest correction: a flood of
corrections on one turn trains once.

A correction is trained on as written: turn this on only where the users who correct are
trusted (``docs/guides/serve.md``).
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from selfrl.chat.template import encode_chat, render
from selfrl.chat.toolcall import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from selfrl.core.trajectory import Trajectory
from selfrl.serve.feedback import served_rewards

_PROBE = [{"role": "user", "content": "?"}]  # any chat: only what the template adds after it matters


def answer_text(text: str, calls: list[dict[str, Any]], compact: bool = False) -> str:
    """The assistant text of a corrected answer: ``text``, then each call as the model writes it;
    ``compact``: the JSON without whitespace, as a grammar-constrained turn samples it
    (:mod:`selfrl.chat.constrain`).

    >>> answer_text("", [{"name": "f", "arguments": {"x": 1}}])
    '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    >>> answer_text("", [{"name": "f", "arguments": {"x": "é"}}], compact=True)
    '<tool_call>{"name":"f","arguments":{"x":"é"}}</tool_call>'
    """
    dumps = (lambda v: json.dumps(v, separators=(",", ":"), ensure_ascii=False)) if compact else json.dumps
    return text + "".join(TOOL_CALL_OPEN + dumps({"name": c["name"], "arguments": c.get("arguments") or {}})
                          + TOOL_CALL_CLOSE for c in calls)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def completion_ids(tokenizer, text: str, eos_ids: list[int]) -> list[int] | None:
    """Token ids the model would sample to answer ``text``: the template's rendering of an
    assistant message with that content after the generation prompt, up to and including
    the first of ``eos_ids``; the content is tokenized as text (control-token strings in it
    stay text, :func:`selfrl.chat.template.encode_chat`). None when the template's rendering
    does not extend its generation prompt, or no end-of-turn token follows the content."""
    head = render(tokenizer, _PROBE, add_generation_prompt=True)
    full = render(tokenizer, [*_PROBE, {"role": "assistant", "content": text}], add_generation_prompt=False)
    if not full.startswith(head):
        return None
    ids = encode_chat(tokenizer, full[len(head):], [text])
    ends = [i for i, t in enumerate(ids) if t in set(eos_ids)]
    return ids[:ends[0] + 1] if ends else None


def demonstrations(batch: list[tuple[Trajectory, dict]], found: dict[tuple[str, int], tuple[str, list]],
                   tokenizer, eos_ids: list[int], version: int, max_len: int,
                   weights: dict[str, float]) -> tuple[list[Trajectory], Counter]:
    """One demonstration per turn of ``batch`` that ``found`` holds a correction for.

    Args:
        batch: ``(turn, served row)`` pairs of the update (rows with ``response_id``, ``choice``,
            ``group_key``).
        found: ``{(response_id, choice): (text, calls)}`` (:func:`selfrl.record.served.corrections`).
        version: the version the learner holds (the demonstrations' ``adapter_version``).
        max_len: the most completion tokens a demonstration may have.
        weights: ``learner.reward_weights``.

    Returns:
        ``(demonstrations, skipped)``: the trajectories, scored (``reward``, ``rewards``,
        ``group_id``), and ``{reason: count}`` of the corrections left out.
    """
    out, skipped = [], Counter()
    for turn, row in batch:
        hit = found.get((row["response_id"], row["choice"]))
        if hit is None:
            continue
        text, calls = hit
        kinds = {c.get("kind") for c in turn.constraints}
        if not calls and "tool_call" in kinds:
            skipped["no calls for a turn that had to call a tool"] += 1
            continue
        if "json" in kinds and (calls or not _is_json(text)):
            skipped["not the JSON the turn's response_format asked for"] += 1
            continue
        if "json" in kinds:  # as the grammar samples it: compact
            text = json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False)
        ids = completion_ids(tokenizer, answer_text(text, calls, compact="tool_call" in kinds), eos_ids)
        if ids is None:
            skipped["the chat template cannot render it as the turn's answer"] += 1
            continue
        if len(ids) > max_len:
            skipped[f"longer than max_completion_length ({max_len})"] += 1
            continue
        prompt = turn.token_ids[:turn.prompt_len]
        rewards, total = served_rewards(1.0, 1.0 if calls else None, weights)
        content = text or None
        out.append(Trajectory(
            turn.task_id, row["group_key"], version, prompt_len=len(prompt), token_ids=prompt + ids,
            completion_mask=[0] * len(prompt) + [1] * len(ids), logprobs=[0.0] * (len(prompt) + len(ids)),
            messages=[*turn.messages[:-1], {"role": "assistant", "content": content,
                                            **({"tool_calls": calls} if calls else {})}],
            final_answer=None if calls else text, num_turns=1, rewards=rewards, reward=total,
            id=f"{turn.id}-correction", parent_id=turn.id))
    return out, skipped

"""Corrections as demonstrations: what a user said the answer should have been, trained beside
the turn it corrects (``learner.learn_from_corrections``: ``"calls"`` for corrections that carry
calls, ``"all"`` for text ones too; a final answer given alone as text can teach the model to skip
the tools that would reach it).

A rating says only whether a turn was right. A correction that carries the right answer
(``POST /v1/feedback`` with ``correction`` text and/or ``correction_tool_calls``) says what
to do instead; with the setting on, the learner turns it into one more trajectory of the
update (:func:`demonstrations`):

* **Tokens.** The corrected turn's own prompt ids, then the assistant message ``{content:
  text + each call in the model's call format}`` as the chat template renders it after them
  (:func:`completion_ids`), up to and including the first end-of-turn token; for a turn
  decoded under a grammar, its JSON compact, as the grammar samples it, and only if that
  grammar accepts those ids. The user's text and the calls' JSON are tokenized as text (a
  control-token string in them stays text); the call tags are the tokens the model writes.
  So the demonstration is the answer the served model could have sampled, in the exact
  context the user saw.
* **Reward and group.** The reward of an answer its user judged right (``user_feedback`` +1,
  and ``tool_success`` 1 when it makes calls, weighted by ``learner.reward_weights``), raised
  to the best reward of its turn's group (its ``group_key``) when that is higher
  (:func:`with_its_group`): a right answer never scores below another answer of its group, so
  its advantage is never negative. Where its whole group scores as it does (its turn was rated
  +1 too) it carries no signal: the update counts it among ``corrections_left_out``
  (:func:`signal_report`), not among its ``demonstrations``.
* **Loss.** The same clipped loss as every turn. Its behaviour log-probs are the learner's
  own (the learner recomputes them for every turn before an update), so its ratio is 1 and
  its gradient is ``advantage x grad log pi(demonstration)``: supervised learning on the
  correction, weighted by how much better it is than its group. Its log-probs are taken
  under its turn's grammar, as the turn's are (the learner replays the masks: the tokens the
  grammar forbids take no probability mass, so the update moves only the choices the model
  really has), and it carries the version the learner holds, so the age rule gives it weight 1. This is the mixed-policy group of LUFFY (Yan et al., 2025,
  "Learning to Reason under Off-Policy Guidance", arXiv:2504.14945), without its policy shaping.

A correction is left out (``skip`` reasons, counted by the update) when it cannot be the
turn's answer: it is empty (no text but blank space, no calls) or its text holds the call
format's tags (calls go in ``correction_tool_calls``); the turn was decoded under a grammar
(``tool_choice``, ``response_format``) that would not let the model write it (no call where
one was required, text beside the one call, a tool not offered, arguments the schema refuses,
not the JSON asked for); it calls a tool its turn was not offered, or with arguments that tool's
schema refuses, whether or not the turn had a grammar (:func:`offered_problem`); the template does not render the message after the generation
prompt; the demonstration is longer than ``max_completion_length`` or than the model's
context leaves after its prompt; or it has no end-of-turn token. One demonstration per turn,
from its newest correction: a flood of corrections on one turn trains once, and choices of
one response corrected with the same answer train it once.

A correction is trained on as written: turn this on only where the users who correct are
trusted (``docs/concepts/serving.md``).
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from selfrl.chat.template import encode_chat, render
from selfrl.chat.toolcall import STRICT_JSON, TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from selfrl.core.tools import Tool, ToolError, validate_arguments
from selfrl.core.trajectory import Trajectory
from selfrl.core.wording import plain, shown
from selfrl.serve.feedback import served_rewards
from selfrl.serve.errors import non_finite_path

_PROBE = [{"role": "user", "content": "?"}]  # any chat: only what the template adds after it matters


def _dumps(value: Any, compact: bool) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False) if compact else json.dumps(value)


def _bodies(calls: list[dict[str, Any]], compact: bool) -> list[str]:
    """The JSON of each call between its tags."""
    return [_dumps({"name": c["name"], "arguments": c.get("arguments") or {}}, compact) for c in calls]


def answer_text(text: str, calls: list[dict[str, Any]], compact: bool = False) -> str:
    """The assistant text of a corrected answer: ``text``, then each call as the model writes it;
    ``compact``: the JSON without whitespace, as a grammar-constrained turn samples it
    (:mod:`selfrl.chat.constrain`).

    >>> answer_text("", [{"name": "f", "arguments": {"x": 1}}])
    '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    >>> answer_text("", [{"name": "f", "arguments": {"x": "é"}}], compact=True)
    '<tool_call>{"name":"f","arguments":{"x":"é"}}</tool_call>'
    """
    return text + "".join(TOOL_CALL_OPEN + b + TOOL_CALL_CLOSE for b in _bodies(calls, compact))


def says_answer(text: str | None, calls: list[dict[str, Any]] | None) -> str | None:
    """Why a correction cannot be an answer whatever its turn, or None when it can: it says
    nothing (no text but blank space, no calls), or its text holds the call format's tags
    (calls go in ``correction_tool_calls``: a call written in the text would train a call that
    no reward checks)."""
    text = text or ""
    if not text.strip() and not calls:
        return "an empty answer (no text, no calls)"
    if TOOL_CALL_OPEN in text or TOOL_CALL_CLOSE in text:
        return (f"its text holds tool-call markup ({TOOL_CALL_OPEN}): send the calls as correction_tool_calls")
    for i, call in enumerate(calls or []):
        if (where := non_finite_path(call.get("arguments") if isinstance(call, dict) else None)) is not None:
            # a request is refused this (a 400); a correction stored before that rule still reads back
            return (f"correction_tool_calls[{i}].arguments{'' if where == '.' else where} is not a finite number "
                    "(NaN and infinities are not JSON)")
    return None


def row_tools(row: dict[str, Any] | None) -> list[dict[str, Any]] | None:
    """The tools a served row's turn could call (its ``tools`` column, ``ServedTurn.tools``), or
    None when not known: no row, or one stored before the column existed."""
    return None if row is None or row.get("tools") is None else json.loads(row["tools"])


def offered_problem(calls: list[dict[str, Any]] | None, tools: list[dict[str, Any]] | None) -> str | None:
    """Why ``calls`` cannot be those of a turn that could call ``tools``, or None when they can.

    A call to a tool the turn was not offered, or with arguments its schema refuses
    (:func:`selfrl.core.tools.validate_arguments`, the check a served call gets), would teach
    the model a call it could never make there. Checked for every turn, decoded under a grammar
    or not.

    Args:
        calls: the correction's calls, ``[{"name", "arguments": {...}}]``.
        tools: the turn's, ``[{"name", "parameters"}]`` (``ServedTurn.tools``: ``[]`` when it
            could call none); None when not known (a turn stored before they were): not checked.

    >>> offered_problem([{"name": "f", "arguments": {}}], [])
    "correction_tool_calls[0] calls 'f', and its turn could call no tool"
    >>> offered_problem([{"name": "f", "arguments": {}}], None) is None
    True
    """
    if tools is None or not calls:
        return None
    by_name = {t["name"]: t for t in tools}
    for i, call in enumerate(calls):
        name = call.get("name")
        if name not in by_name:
            offered = ", ".join(n if plain(n) else shown(n) for n in sorted(by_name))
            return (f"correction_tool_calls[{i}] calls {shown(str(name))}, and its turn could call no tool"
                    if not by_name else
                    f"correction_tool_calls[{i}] calls {shown(str(name))}, a tool its turn was not offered "
                    f"(offered: {offered})")
        try:
            validate_arguments(Tool(name, "", by_name[name].get("parameters") or {}, str), call.get("arguments"))
        except (ToolError, ValueError) as e:
            return f"correction_tool_calls[{i}].arguments: {e}"
    return None


def setting_refuses(use: str, calls: list | None) -> str | None:
    """Why ``learner.learn_from_corrections = use`` leaves a correction with ``calls`` out, or None.

    >>> setting_refuses("calls", []) is not None, setting_refuses("calls", [{"name": "f"}]), setting_refuses("all", [])
    (True, None, None)
    """
    if use == "off":
        return "learner.learn_from_corrections is off (\"calls\" or \"all\" trains corrections as demonstrations)"
    if use == "calls" and not calls:
        return ("learner.learn_from_corrections = \"calls\" trains only corrections that carry the calls "
                "(correction_tool_calls); \"all\" trains text too")
    return None


def _is_json(text: str) -> bool:
    """Whether ``text`` is one JSON value whose numbers are all finite (:data:`STRICT_JSON`)."""
    try:
        STRICT_JSON.decode(text)
    except (ValueError, RecursionError):
        return False
    return True


def completion_ids(tokenizer, text: str, eos_ids: list[int], calls: list[dict[str, Any]] | None = None,
                   compact: bool = False) -> list[int] | None:
    """Token ids the model would sample to answer ``text`` and then ``calls``
    (:func:`answer_text`): the template's rendering of an assistant message with that content
    after the generation prompt, up to and including the first of ``eos_ids``. The text and
    each call's JSON are tokenized as text (control-token strings in them stay text,
    :func:`selfrl.chat.template.encode_chat`); the call tags as the model writes them (a
    tokenizer that makes ``<tool_call>`` a special token gets that token). None when the
    template's rendering does not extend its generation prompt, does not hold the content as
    given, or no end-of-turn token follows the content."""
    head = render(tokenizer, _PROBE, add_generation_prompt=True)
    content = answer_text(text, calls or [], compact)
    full = render(tokenizer, [*_PROBE, {"role": "assistant", "content": content}], add_generation_prompt=False)
    if not full.startswith(head):
        return None
    try:
        ids = encode_chat(tokenizer, full[len(head):], [text, *_bodies(calls or [], compact)])
    except ValueError:  # the template changed the content beyond recognition
        return None
    ends = [i for i, t in enumerate(ids) if t in set(eos_ids)]
    return ids[:ends[0] + 1] if ends else None


def _grammar_refuses(constraint: dict, ids: list[int], tokenizer, vocab_size: int, eos_ids: list[int]) -> bool:
    """Whether the turn's grammar (a ``Trajectory.constraints`` entry) would not let the model
    sample ``ids`` (a tool it did not offer or name, arguments its schema refuses, text beside
    the one call it allows, a second call...)."""
    from selfrl.chat.constrain import Constraint, ConstraintError, replay_masks

    try:
        replay_masks(Constraint(constraint["kind"], constraint["grammar"]), ids, tokenizer, vocab_size, eos_ids)
    except ConstraintError:
        return True
    return False


def _shape_problem(kind: str | None, text: str, calls: list) -> str | None:
    """Why an answer of ``text`` and ``calls`` cannot be that of a turn decoded under a grammar
    of ``kind`` (None: no grammar), or None."""
    if kind == "tool_call" and not calls:
        return "no calls for a turn that had to call a tool"
    if kind == "json" and (calls or not _is_json(text)):
        return "not the JSON the turn's response_format asked for"
    if kind == "tool_call_or_json" and not ((calls and not text.strip()) or (not calls and _is_json(text))):
        return "neither one tool call nor the JSON the turn's response_format asked for"
    return None


def demonstrations(batch: list[tuple[Trajectory, dict]], found: dict[tuple[str, int], tuple[str, list]],
                   tokenizer, eos_ids: list[int], version: int, max_len: int,
                   weights: dict[str, float], context: int | None = None,
                   vocab_size: int | None = None, use: str = "all") -> tuple[list[Trajectory], Counter]:
    """One demonstration per turn of ``batch`` that ``found`` holds a correction for.

    Args:
        batch: ``(turn, served row)`` pairs of the update (rows with ``response_id``, ``choice``,
            ``group_key``, and optionally ``tools``: the JSON of ``ServedTurn.tools``, None or absent
            when not known).
        found: ``{(response_id, choice): (text, calls)}`` (:func:`selfrl.record.served.corrections`).
        version: the version the learner holds (the demonstrations' ``adapter_version``).
        max_len: the most completion tokens a demonstration may have.
        weights: ``learner.reward_weights``.
        context: the most tokens, prompt and completion, the learner's model attends to; None: no limit.
        vocab_size: V of the model's output layer, to replay a turn's grammar on its
            demonstration; None: ``len(tokenizer)``.
        use: ``learner.learn_from_corrections`` (``"calls"``: a correction without calls is left out).

    Returns:
        ``(demonstrations, skipped)``: the trajectories, scored (``reward``, ``rewards``,
        ``group_id``), and ``{reason: count}`` of the corrections left out. The choices of one
        response share a prompt: one corrected the same way as another adds no demonstration.
    """
    out, skipped, made = [], Counter(), set()
    vocab_size = len(tokenizer) if vocab_size is None else vocab_size
    for turn, row in batch:
        hit = found.get((row["response_id"], row["choice"]))
        if hit is None:
            continue
        text, calls = hit
        if (why := setting_refuses(use, calls)) is not None:
            skipped[why] += 1
            continue
        grammar = turn.constraints[0] if turn.constraints else None  # a served turn has one or none
        kind = None if grammar is None else grammar.get("kind")
        if (why := says_answer(text, calls) or offered_problem(calls, row_tools(row))
                or _shape_problem(kind, text, calls)) is not None:
            skipped[why] += 1
            continue
        if grammar is not None and not calls:  # the JSON as the grammar samples it: compact
            text = _dumps(json.loads(text), compact=True)
        ids = completion_ids(tokenizer, text, eos_ids, calls, compact=grammar is not None)
        prompt = turn.token_ids[:turn.prompt_len]
        room = max_len if context is None else min(max_len, context - len(prompt))
        if ids is None:
            skipped["the chat template cannot render it as the turn's answer"] += 1
        elif len(ids) > room:
            skipped[f"longer than max_completion_length ({max_len})" if room == max_len else
                    f"longer than the {room} tokens its prompt leaves of the model's context ({context})"] += 1
        elif grammar is not None and _grammar_refuses(grammar, ids, tokenizer, vocab_size, eos_ids):
            skipped[f"the turn's {kind} grammar would not let the model write it (a tool it did not offer, "
                    "arguments its schema refuses, text beside its one call...)"] += 1
        elif (row["response_id"], tuple(ids)) in made:
            skipped["the same answer as a corrected choice of its response (trained once)"] += 1
        else:
            made.add((row["response_id"], tuple(ids)))
            out.append(_demonstration(turn, row, prompt, ids, text, calls, version, weights, grammar))
    return out, skipped


def _demonstration(turn: Trajectory, row: dict, prompt: list[int], ids: list[int], text: str, calls: list,
                   version: int, weights: dict[str, float], grammar: dict | None) -> Trajectory:
    rewards, total = served_rewards(1.0, 1.0 if calls else None, weights)
    P = len(prompt)  # the turn's grammar over the demonstration's tokens (the learner replays its masks)
    constraints = [] if grammar is None else [{**grammar, "start": P, "end": P + len(ids)}]
    return Trajectory(
        turn.task_id, row["group_key"], version, prompt_len=len(prompt), token_ids=prompt + ids,
        completion_mask=[0] * len(prompt) + [1] * len(ids), logprobs=[0.0] * (len(prompt) + len(ids)),
        messages=[*turn.messages[:-1], {"role": "assistant", "content": text or None,
                                        **({"tool_calls": calls} if calls else {})}],
        final_answer=None if calls else text, num_turns=1, rewards=rewards, reward=total,
        id=f"{turn.id}-correction", parent_id=turn.id, constraints=constraints)


def with_its_group(scored: list[Trajectory], demos: list[Trajectory]) -> list[Trajectory]:
    """``demos``, each with a reward no lower than the best of its group in ``scored`` (set in
    place): a right answer never scores below another answer of its group, so its advantage
    is never negative (a text correction, which earns no ``tool_success``, would otherwise sit
    below turns rated +1 whose calls succeeded, and be pushed down)."""
    best: dict[str, float] = {}
    for t in scored:
        if t.reward is not None:
            best[t.group_id] = max(best.get(t.group_id, t.reward), t.reward)
    for d in demos:
        if d.group_id in best and best[d.group_id] > d.reward:
            d.reward = best[d.group_id]
    return demos


def sampled_only(trajs: list[Trajectory], demos: list[Trajectory]) -> list[Trajectory]:
    """``trajs`` less the copies of ``demos`` (by id): the turns a policy sampled, which the new
    candidate's KL probe reads (a demonstration is no policy's sample; the KL estimate on the
    tokens its update pushed up would read as drift)."""
    shown = {d.id for d in demos}
    return [t for t in trajs if t.id not in shown]


def signal_report(seen: dict, demos: list[Trajectory]) -> dict:
    """What an update says of its demonstrations, once advantages are set: ``demonstrations``
    counts those that train (a non-zero advantage); one whose group's rewards are all equal
    (its turn judged as right as it, say) carries no signal and is counted among
    ``corrections_left_out``. ``{}`` when ``seen`` is."""
    if not seen:
        return {}
    flat = [d for d in demos if not d.advantage]
    left = dict(seen["corrections_left_out"])
    if flat:
        left["no signal: its group's rewards were all equal"] = len(flat)
    return {"demonstrations": len(demos) - len(flat), "corrections_left_out": left}

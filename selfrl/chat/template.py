"""Turning chat messages into token ids, for any chat template.

The agent loop never re-tokenizes what the policy generated: it keeps the
sampled ids and appends only the tokens of what comes *between* two assistant
turns (end of turn, the tool message, the next assistant header). Those are
found by rendering a small dummy conversation with the model's own chat
template, so the same code serves ChatML (SmolLM2, Qwen2.5), Qwen3, SmolLM3,
Llama-3.1 and others. The public templates of those five are kept as test fixtures
(``tests/fixtures/chat_templates``) and a two-turn tool round trip is tested with each.

Templates differ in how they render an assistant turn depending on what follows
it: Qwen3 gives the *last* assistant turn an empty ``<think></think>`` block and the
earlier ones none, Llama-3.1 trims the content. So the tokens between two turns are
never found by comparing two renderings of the history; they are read off one
rendering, after the dummy assistant turn's end-of-turn text (see
:func:`between_turns_ids`). The sampled turn itself is always kept as sampled.

**Content never forges control tokens.** The text of a message (user, system, tool,
earlier assistant turns) is tokenized as text: ``<|im_end|>`` written by a user is the
characters ``<``, ``|``, ``im``... and never the end-of-turn token, so a client cannot
close its turn and open a system turn of its own, and a tool result cannot end the
tool message. Only the template's own text yields control tokens (:func:`encode_chat`).
Tool definitions that a template renders itself (native tool support) may not hold
control-token text at all: :func:`prompt_ids` refuses them.
"""

from __future__ import annotations

import json
from typing import Any

from selfrl.chat.prompt_size import fewest_tokens
from selfrl.chat.toolcall import MARKUP_TAGS, TOOL_CALL_OPEN, TOOL_RESPONSE_OPEN

_DUMMY_USER = "x"
_DUMMY_ASSISTANT = "selfrl-assistant-turn-7f3a"  # found once in the rendering


def template_supports_tools(tokenizer) -> bool:
    """True when the model's chat template renders a ``tools`` argument itself *and* asks
    for calls in the ``<tool_call>`` format selfrl parses (Qwen2.5, Qwen3, SmolLM3).

    Llama-3.1's template renders tools but asks for bare JSON with ``parameters``;
    for it (and templates without tools) selfrl writes its own tools section into the
    system prompt instead, so that the format asked for is the one parsed.
    """
    template = getattr(tokenizer, "chat_template", None) or ""
    return "tools" in template and TOOL_CALL_OPEN in template


def template_wraps_tool_responses(tokenizer) -> bool:
    """True when the template itself puts a tool message inside ``<tool_response>`` tags
    (Qwen2.5, Qwen3); selfrl then sends the bare result, so that it is not wrapped twice."""
    return TOOL_RESPONSE_OPEN in (getattr(tokenizer, "chat_template", None) or "")


def render(tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool, tools=None) -> str:
    """The chat template's text for ``messages``.

    Raises:
        ValueError: the tokenizer has no chat template.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this tokenizer has no chat template; selfrl needs one to build prompts")
    kwargs = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )


def control_tokens(tokenizer) -> list[str]:
    """The texts that tokenize to a special (control) token: ``<|im_end|>``, ``<|eot_id|>``..."""
    out = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for t in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).values():
        if getattr(t, "special", False):
            out.add(str(t.content))
    return sorted(out, key=len, reverse=True)


def markup_special_tokens(tokenizer) -> dict[int, str]:
    """The special tokens whose text is a tag of the call format (``selfrl.chat.toolcall.MARKUP_TAGS``),
    by id: Hermes models mark ``<tool_call>`` special, Qwen's do not."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return {i: str(t.content) for i, t in added.items() if getattr(t, "special", False) and str(t.content) in MARKUP_TAGS}


def decode_turn(tokenizer, ids: list[int]) -> str:
    """The text of a sampled turn: special tokens left out (the EOS, a stray header), except a
    call-format tag that the tokenizer marks special (:func:`markup_special_tokens`), which is
    kept as its text so that the call it opens is not lost."""
    keep = markup_special_tokens(tokenizer)
    if not any(i in keep for i in ids):
        return tokenizer.decode(ids, skip_special_tokens=True)
    pieces, run = [], []
    for i in [*ids, None]:
        if i is None or i in keep:
            pieces.append(tokenizer.decode(run, skip_special_tokens=True))
            pieces.append("" if i is None else keep[i])
            run = []
        else:
            run.append(i)
    return "".join(pieces)


def _locate(text: str, content: str, pos: int) -> tuple[int, int] | None:
    """Where ``content`` lies in the rendered ``text`` from ``pos`` on, as the template may
    have written it (as is, trimmed, or JSON-quoted as Llama-3.1 does for tool results)."""
    found = None
    for cand in (content, content.strip(), content.lstrip("\n"), json.dumps(content, ensure_ascii=False)[1:-1],
                 json.dumps(content)[1:-1]):
        i = text.find(cand, pos) if cand else -1
        if i >= 0 and (found is None or i < found[0] or (i == found[0] and i + len(cand) > found[1])):
            found = (i, i + len(cand))
    return found


def encode_chat(tokenizer, text: str, contents: list[str]) -> list[int]:
    """Token ids of rendered chat ``text`` in which each of ``contents`` (in order) is
    tokenized as text: control-token strings inside them do not become control tokens.

    Raises:
        ValueError: a content holding control-token text cannot be found in ``text``
            (the template changed it beyond trimming or JSON quoting).
    """
    specials = control_tokens(tokenizer)
    regions, pos = [], 0
    for c in contents:
        if not isinstance(c, str) or not any(s in c for s in specials):
            continue  # nothing to keep out: tokenized with the rest
        where = _locate(text, c, pos)
        if where is None:
            raise ValueError("chat template: a message holding control-token text could not be found in the "
                             "rendering, so it cannot be kept from forging control tokens")
        regions.append(where)
        pos = where[1]
    ids, pos = [], 0
    for start, end in regions:
        ids += tokenizer(text[pos:start], add_special_tokens=False)["input_ids"]
        ids += tokenizer(text[start:end], add_special_tokens=False, split_special_tokens=True)["input_ids"]
        pos = end
    return ids + tokenizer(text[pos:], add_special_tokens=False)["input_ids"]


class PromptTooLong(ValueError):
    """A prompt that cannot fit, found before tokenizing it: ``tokens`` is a lower bound of its
    length (:func:`selfrl.chat.prompt_size.fewest_tokens`), over ``limit``."""

    def __init__(self, tokens: int, limit: int):
        super().__init__(f"the prompt is at least {tokens} tokens, over the limit of {limit}")
        self.tokens, self.limit = tokens, limit


def prompt_ids(tokenizer, messages: list[dict[str, Any]], tools=None, max_tokens: int | None = None) -> list[int]:
    """Token ids of ``messages`` followed by the assistant header (the first prompt); the
    messages' contents are tokenized as text (:func:`encode_chat`).

    With ``max_tokens``, a prompt that surely has more tokens is refused before it is
    tokenized (tokenizing megabytes costs seconds and memory): first from the contents of
    its non-assistant messages, which every supported template renders whole (trimmed at
    most), before rendering; then from the rendered text (:func:`selfrl.chat.prompt_size.fewest_tokens`).

    Raises:
        PromptTooLong: the prompt has more than ``max_tokens`` tokens (a lower bound in it).
        ValueError: no chat template; ``tools`` (rendered by the template) hold control-token
            text; a content with control-token text cannot be located in the rendering.
    """
    if max_tokens is not None:
        contents = [m["content"].strip() for m in messages
                    if m.get("role") != "assistant" and isinstance(m.get("content"), str)]
        _refuse_beyond(tokenizer, contents, max_tokens)
    text = render(tokenizer, messages, add_generation_prompt=True, tools=tools)
    if max_tokens is not None:
        _refuse_beyond(tokenizer, [text], max_tokens)
    if tools:
        blob = json.dumps(tools, ensure_ascii=False)
        found = [s for s in control_tokens(tokenizer) if s in blob]
        if found:
            raise ValueError(f"tool definitions may not contain control-token text ({found[0]!r})")
    return encode_chat(tokenizer, text, [m.get("content") for m in messages])


def _refuse_beyond(tokenizer, texts: list[str], max_tokens: int) -> None:
    floor = fewest_tokens(tokenizer, *texts)
    if floor > max_tokens:
        raise PromptTooLong(floor, max_tokens)


def between_turns_ids(tokenizer, tool_contents: list[str], eos_text: str) -> list[int]:
    """Ids that follow a finished assistant turn (its EOS already sampled) when tools answer.

    Renders ``[user, assistant, tool...]`` with a generation prompt and keeps what
    follows the dummy assistant turn's first ``eos_text``: the rest of its end of turn
    (for ChatML a newline), the tool messages and the next assistant header. How the
    template renders the assistant turn itself (an empty think block, trimming) does
    not matter: the sampled turn is kept as sampled.

    Args:
        tool_contents: the content of each tool message, in order.
        eos_text: the text of the EOS token that ended the assistant turn.

    Raises:
        ValueError: the template drops the assistant turn, or does not end it with
            ``eos_text``.
    """
    head = [{"role": "user", "content": _DUMMY_USER}, {"role": "assistant", "content": _DUMMY_ASSISTANT}]
    tools = [{"role": "tool", "content": c} for c in tool_contents]
    after = render(tokenizer, head + tools, add_generation_prompt=True)
    at = after.find(_DUMMY_ASSISTANT)
    if at < 0:
        raise ValueError("chat template: the assistant turn is not rendered when a tool message follows")
    cut = after.find(eos_text, at + len(_DUMMY_ASSISTANT))
    if cut < 0:
        raise ValueError(f"chat template does not end an assistant turn with the EOS token {eos_text!r}")
    return encode_chat(tokenizer, after[cut + len(eos_text):], tool_contents)

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
"""

from __future__ import annotations

from typing import Any

from selfrl.toolcall import TOOL_CALL_OPEN, TOOL_RESPONSE_OPEN

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


def prompt_ids(tokenizer, messages: list[dict[str, Any]], tools=None) -> list[int]:
    """Token ids of ``messages`` followed by the assistant header (the first prompt)."""
    text = render(tokenizer, messages, add_generation_prompt=True, tools=tools)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


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
    return tokenizer(after[cut + len(eos_text):], add_special_tokens=False)["input_ids"]

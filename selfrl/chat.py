"""Turning chat messages into token ids, for any chat template.

The agent loop never re-tokenizes what the policy generated: it keeps the
sampled ids and appends only the tokens of what comes *between* two assistant
turns (end of turn, the tool message, the next assistant header). Those are
found by rendering a small dummy conversation with the model's own chat
template, so the same code serves ChatML (SmolLM2, Qwen2.5), Llama-3 and others.
"""

from __future__ import annotations

from typing import Any

_DUMMY_USER = "x"
_DUMMY_ASSISTANT = "y"


def template_supports_tools(tokenizer) -> bool:
    """True when the model's chat template renders a ``tools`` argument itself."""
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


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

    Renders ``[user, assistant, tool...]`` with a generation prompt and subtracts the
    rendering of ``[user, assistant]``; what lies after the assistant's EOS text in
    the latter (for ChatML a newline) is kept too.

    Args:
        tool_contents: the content of each tool message, in order.
        eos_text: the text of the EOS token that ended the assistant turn.

    Raises:
        ValueError: the template renders the dummy prefix differently when tool
            messages follow (no clean split exists).
    """
    head = [{"role": "user", "content": _DUMMY_USER}, {"role": "assistant", "content": _DUMMY_ASSISTANT}]
    tools = [{"role": "tool", "content": c} for c in tool_contents]
    before = render(tokenizer, head, add_generation_prompt=False)
    after = render(tokenizer, head + tools, add_generation_prompt=True)
    if not after.startswith(before):
        raise ValueError("chat template: rendering changes the earlier turns when a tool message follows")
    cut = before.rfind(eos_text)
    if cut < 0:
        raise ValueError(f"chat template does not end an assistant turn with the EOS token {eos_text!r}")
    tail = before[cut + len(eos_text):] + after[len(before):]
    return tokenizer(tail, add_special_tokens=False)["input_ids"]

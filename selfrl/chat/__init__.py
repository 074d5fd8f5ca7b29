"""Chat messages and token ids: what the model reads and writes around its tokens.

- :mod:`selfrl.chat.template`: chat messages to token ids with the model's own template,
  never re-tokenizing what the policy generated.
- :mod:`selfrl.chat.toolcall`: tool calls in plain text (Hermes ``<tool_call>`` blocks),
  rendered and parsed.
- :mod:`selfrl.chat.prompt_size`: the fewest tokens a text can become, from its bytes, so a
  prompt far beyond the context is refused before the tokenizer reads it.
- :mod:`selfrl.chat.constrain`: constrained decoding, a grammar that masks the logits so a
  turn is a tool call or schema-valid JSON by construction.
"""

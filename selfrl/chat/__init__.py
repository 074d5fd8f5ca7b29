"""Chat messages and token ids: the chat template, tool calls in text, and grammars."""

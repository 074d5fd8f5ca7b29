import copy

import pytest

from selfrl.chat.template import between_turns_ids, prompt_ids, render, template_supports_tools


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_tiny_tokenizer_is_lossless_and_pads_with_eos(tiny_tokenizer):
    tok = tiny_tokenizer
    assert tok.pad_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    for text in ["héllo  wörld 🤖\n\n  x ", '<tool_call>{"name": "c"}</tool_call><|im_end|>\n', "  日本語"]:
        assert tok.decode(ids(tok, text)) == text


def test_between_turns_one_tool_message(tiny_tokenizer):
    got = between_turns_ids(tiny_tokenizer, ["the result"], "<|im_end|>")
    assert got == ids(tiny_tokenizer, "\n<|im_start|>tool\nthe result<|im_end|>\n<|im_start|>assistant\n")


def test_between_turns_two_tool_messages(tiny_tokenizer):
    contents = ["<tool_response>\n42\n</tool_response>", "<tool_response>\nerror: bad\n</tool_response>"]
    got = between_turns_ids(tiny_tokenizer, contents, "<|im_end|>")
    want = (
        f"\n<|im_start|>tool\n{contents[0]}<|im_end|>\n"
        f"<|im_start|>tool\n{contents[1]}<|im_end|>\n<|im_start|>assistant\n"
    )
    assert got == ids(tiny_tokenizer, want)


def test_between_turns_rejects_an_eos_the_template_does_not_use(tiny_tokenizer):
    with pytest.raises(ValueError, match="EOS token"):
        between_turns_ids(tiny_tokenizer, ["r"], "<|endoftext|>")


def test_prompt_ids_end_with_the_assistant_header(tiny_tokenizer):
    tok = tiny_tokenizer
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "What is 17+25?"}]
    got = prompt_ids(tok, msgs)
    want = "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nWhat is 17+25?<|im_end|>\n<|im_start|>assistant\n"
    assert got == ids(tok, want)
    assert got[-len(ids(tok, "<|im_start|>assistant\n")):] == ids(tok, "<|im_start|>assistant\n")
    assert not template_supports_tools(tok)


def test_missing_chat_template_is_an_error(tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = None
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="no chat template"):
        prompt_ids(tok, msgs)
    with pytest.raises(ValueError, match="no chat template"):
        render(tok, msgs, add_generation_prompt=False)
    with pytest.raises(ValueError, match="no chat template"):
        between_turns_ids(tok, ["r"], "<|im_end|>")

"""The fewest tokens a text can become (selfrl.chat.prompt_size): never more than the tokenizer
gives, for every supported family's tokenizer and for texts built to beat the bound; and
what the bound rests on: every supported template renders each non-assistant content whole."""

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from conftest import _CORPUS
from selfrl.chat.template import PromptTooLong, prompt_ids, render
from selfrl.chat.prompt_size import bytes_per_token, fewest_tokens
from test_chat_templates import FAMILIES, family_tokenizer

HOSTILE = [
    "",
    "hello world 12345 lorem ipsum " * 50,
    " " * 3000,  # a long whitespace run: the longest pieces of real vocabularies
    "\n" + " " * 500 + "#" * 500,
    "<|im_start|><|im_end|>" * 40,  # control-token text: one added token each where it is one
    "<tool_call></tool_call><think>" * 40,
    "\x04\x13\x1d" * 200,  # control bytes that some vocabularies lack (they drop them)
    "你好，世界。" * 100 + "\U00040000\U0001f600" * 50,  # 3- and 4-byte characters
    "e\u0301" * 300 + "\u1100\u1161\u11a8" * 300,  # what NFC composes
    "".join(map(chr, range(32, 3000))),
]


def sentencepiece_style() -> PreTrainedTokenizerFast:
    """A Llama-2-style BPE: NFC, spaces replaced by '▁', every byte as a <0xNN> fallback piece."""
    bpe = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    bpe.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    bpe.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"]
                                  + [f"<0x{b:02X}>" for b in range(256)], show_progress=False)
    bpe.train_from_iterator(_CORPUS * 2, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", eos_token="</s>")


def tokenizers_under_test(tiny_tokenizer):
    return {"tiny": tiny_tokenizer, "sentencepiece": sentencepiece_style(),
            **{name: family_tokenizer(f) for name, f in FAMILIES.items()}}


def test_the_bound_never_exceeds_what_the_tokenizer_gives(tiny_tokenizer):
    for name, tok in tokenizers_under_test(tiny_tokenizer).items():
        assert bytes_per_token(tok) is not None, name
        for text in HOSTILE:
            real = len(tok(text, add_special_tokens=False)["input_ids"])
            assert fewest_tokens(tok, text) <= real, (name, text[:20])
            assert fewest_tokens(tok, text, text) <= len(tok(text + text, add_special_tokens=False)["input_ids"])
        assert fewest_tokens(tok, "x" * 100_000) >= 100_000 / 300, name  # and it is a bound worth having


def test_a_tokenizer_that_drops_text_gives_no_bound():
    # WordPiece (an unknown word is one token) after a whitespace pre-tokenizer that removes spaces
    wp = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    wp.pre_tokenizer = pre_tokenizers.Whitespace()
    wp.train_from_iterator(_CORPUS, trainers.WordPieceTrainer(vocab_size=200, special_tokens=["[UNK]"],
                                                               show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=wp, unk_token="[UNK]")
    assert bytes_per_token(tok) is None and fewest_tokens(tok, " " * 10_000) == 0
    assert len(tok(" " * 10_000)["input_ids"]) == 0  # why: no bound holds for it


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_template_renders_each_non_assistant_content_whole(name):
    # prompt_ids counts these contents before rendering (the first refusal); it rests on this
    tok = family_tokenizer(FAMILIES[name])
    contents = {"system": " system text 1111 ", "user": "user text 2222\n", "tool": "tool text 3333"}
    messages = [{"role": "system", "content": contents["system"]}, {"role": "user", "content": contents["user"]},
                {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
                    "name": "calculator", "arguments": {"expression": "1+1"}}}]},
                {"role": "tool", "content": contents["tool"]}, {"role": "user", "content": contents["user"]}]
    text = render(tok, messages, add_generation_prompt=True)
    for c in contents.values():
        assert c.strip() in text


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized(tiny_tokenizer, monkeypatch):
    seen = []
    real = type(tiny_tokenizer).__call__

    def counting(self, text=None, *args, **kwargs):  # characters handed to the tokenizer
        seen.append(len(text) if isinstance(text, str) else sum(map(len, text)))
        return real(self, text, *args, **kwargs)

    monkeypatch.setattr(type(tiny_tokenizer), "__call__", counting)
    big = "hello world " * 100_000
    for messages in ([{"role": "user", "content": big}],  # refused from the contents, before rendering
                     [{"role": "user", "content": ""}] * 20_000):  # from the rendered text
        with pytest.raises(PromptTooLong) as e:
            prompt_ids(tiny_tokenizer, messages, max_tokens=8191)
        assert e.value.tokens > 8191 and e.value.limit == 8191
    assert seen == []
    assert len(prompt_ids(tiny_tokenizer, [{"role": "user", "content": "hi"}], max_tokens=8191)) > 1
    assert 0 < sum(seen) < 200

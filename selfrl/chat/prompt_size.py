"""The fewest tokens a text can become, from its length in bytes, without tokenizing it.

A prompt far beyond the model's context should be refused before the tokenizer reads
it: tokenizing a 4 MB prompt takes seconds of CPU and hundreds of MB that the process
keeps. The bound: when every byte of a text is covered by some token and no token
covers more than ``L`` bytes, a text of ``n`` bytes is at least ``ceil(n / L)`` tokens,
whatever the text. ``L`` is read off the vocabulary once per tokenizer
(:func:`bytes_per_token`): the longest piece in bytes, an added token's text included.

That holds for the tokenizers that cover every byte and drop none:

* byte-level BPE (GPT-2's byte map: SmolLM2, Qwen2.5, Qwen3, Llama-3, SmolLM3) whose
  vocabulary holds all 256 byte symbols; each piece's character is one byte;
* SentencePiece-style BPE with byte fallback (Llama-2, Mistral, Phi-3, Gemma): every
  ``<0x00>``..``<0xFF>`` piece present; a piece's bytes are its UTF-8 (``▁`` is the
  space the normalizer made 3 bytes of, so the count only grows);

and only when the pre-tokenizer removes nothing (no ``Whitespace`` or ``removed``
splits) and the normalizer shrinks text by a known factor at most: none, ``Prepend``,
a ``Replace`` by text no shorter; the Unicode forms (NFC, NFKC, NFD, NFKD) and
``Lowercase`` by at most 3 (Hangul jamo compose 9 bytes into 3; the Kelvin sign, 3
bytes, lowercases to "k"). Any other tokenizer (WordPiece, whose unknown word is one
token; a normalizer that strips text) has no bound here: :func:`bytes_per_token` is
None and a prompt is tokenized whole, as before.
"""

from __future__ import annotations

import json
import math
import re
from functools import lru_cache
from typing import Any

_UNICODE_FORMS = {"NFC", "NFKC", "NFD", "NFKD", "Lowercase"}  # shrink UTF-8 bytes by at most 3
_KEEPING_SPLITS = {"Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous"}  # not "Removed"


def _shrink(spec: dict[str, Any] | None) -> float | None:
    """How many times fewer bytes ``spec`` (a normalizer, as JSON) can leave of a text; None
    when it can delete text."""
    if spec is None:
        return 1.0
    kind = spec.get("type")
    if kind == "Sequence":
        factor = 1.0
        for part in spec.get("normalizers", []):
            f = _shrink(part)
            if f is None:
                return None
            factor *= f
        return factor
    if kind in _UNICODE_FORMS:
        return 3.0
    if kind == "Prepend":
        return 1.0
    if kind == "Replace" and "String" in (spec.get("pattern") or {}):
        old, new = spec["pattern"]["String"].encode(), str(spec.get("content", "")).encode()
        return None if not new else max(1.0, len(old) / len(new))
    return None


def _keeps_every_byte(spec: dict[str, Any] | None, byte_level: bool) -> bool:
    """Whether the pre-tokenizer ``spec`` (as JSON) keeps all text, and is byte-level when
    ``byte_level`` is asked for."""
    parts = [] if spec is None else spec.get("pretokenizers", [spec]) if spec.get("type") == "Sequence" else [spec]
    kinds = [p.get("type") for p in parts]
    if byte_level and "ByteLevel" not in kinds:
        return False
    for p in parts:
        kind = p.get("type")
        if kind == "Split" and p.get("behavior") not in _KEEPING_SPLITS:
            return False
        if kind not in ("ByteLevel", "Metaspace", "Split", "Digits", "Punctuation", "UnicodeScripts"):
            return False
    return True


def _uncovered_chars(missing: set[int]) -> re.Pattern | None:
    """A pattern matching each character whose UTF-8 holds one of the ``missing`` bytes (each
    holds one: an ASCII character, or a lead byte; ``missing`` holds no continuation byte),
    or None when there is none. Bytes that UTF-8 never uses (0xC0, 0xC1, 0xF5-0xFF) are
    ignored."""
    ranges = []
    for b in sorted(missing):
        if b < 0x80:
            lo = hi = b
        elif 0xC2 <= b < 0xE0:
            lo = (b & 0x1F) << 6
            hi = lo + 0x3F
        elif 0xE0 <= b < 0xF0:
            lo = max((b & 0x0F) << 12, 0x800)
            hi = ((b & 0x0F) << 12) + 0xFFF
        elif 0xF0 <= b < 0xF5:
            lo = max((b & 0x07) << 18, 0x10000)
            hi = min(((b & 0x07) << 18) + 0x3FFFF, 0x10FFFF)
        else:
            continue
        ranges.append(f"{re.escape(chr(lo))}-{re.escape(chr(hi))}")
    return re.compile("[" + "".join(ranges) + "]") if ranges else None


@lru_cache(maxsize=1)
def _byte_symbols() -> dict[str, int]:
    """GPT-2's byte map, as byte-level vocabularies write bytes: the character of each byte
    (printable bytes as themselves, the others as U+0100 on, in order)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(0x100 + k): b for k, b in enumerate(others)}}


@lru_cache(maxsize=8)
def _rules(tokenizer, size: int) -> tuple[float, re.Pattern | None] | None:
    """``(bytes per token, characters no piece covers)``, or None (see :func:`bytes_per_token`)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a slow (Python) tokenizer: nothing to read the rules off
        return None
    state = lambda part: None if part is None else json.loads(part.__getstate__())  # noqa: E731
    model, normalizer, pre = state(backend.model), state(backend.normalizer), state(backend.pre_tokenizer)
    shrink = _shrink(normalizer)
    if model.get("type") != "BPE" or shrink is None:  # (BPE dropout only splits more: the bound holds)
        return None
    vocab = tokenizer.get_vocab()
    added = {i: str(getattr(t, "content", t)) for i, t in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).items()}
    uncovered = None
    if _keeps_every_byte(pre, byte_level=True):
        missing = {b for c, b in _byte_symbols().items() if c not in vocab}  # dropped wherever they occur
        if any(0x80 <= b < 0xC0 for b in missing):  # a continuation byte: too many characters hold one
            return None
        uncovered = _uncovered_chars(missing)
        longest = max(len(p) for p, i in vocab.items() if i not in added)  # one character per byte
    elif model.get("byte_fallback") and _keeps_every_byte(pre, byte_level=False):
        if not all(f"<0x{b:02X}>" in vocab for b in range(256)):
            return None
        longest = max(len(p.encode()) for p, i in vocab.items() if i not in added)
    else:
        return None
    per = float(max(shrink * longest, max((len(t.encode()) for t in added.values()), default=1)))
    return per, uncovered


def bytes_per_token(tokenizer) -> float | None:
    """The most bytes of a request's text that one token of ``tokenizer`` can stand for
    (the longest vocabulary piece, times the normalizer's shrink factor; see the module
    docstring), or None when the tokenizer gives no such bound. Cached per tokenizer and
    vocabulary size.

    >>> from selfrl.testing import build_tiny_tokenizer
    >>> bytes_per_token(build_tiny_tokenizer())
    13.0
    """
    rules = _rules(tokenizer, len(tokenizer))
    return None if rules is None else rules[0]


def fewest_tokens(tokenizer, *texts: str) -> int:
    """A lower bound of the tokens ``tokenizer`` gives any text that holds all of ``texts``
    (the contents of a rendered prompt, or the whole of it): ``ceil(bytes / bytes_per_token)``,
    not counting characters that no piece covers (a vocabulary without some control bytes
    drops them); 0 when the tokenizer gives no bound. Reads each text once; no copy of ASCII text.

    >>> from selfrl.testing import build_tiny_tokenizer
    >>> fewest_tokens(build_tiny_tokenizer(), "x" * 130, "y")
    11
    """
    rules = _rules(tokenizer, len(tokenizer))
    if rules is None:
        return 0
    per, uncovered = rules
    n = 0
    for text in texts:
        n += len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
        if uncovered is not None:
            n -= uncovered.subn("", text)[1]  # (C speed; a list of the matches could be millions long)
    return math.ceil(n / per)

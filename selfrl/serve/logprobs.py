"""OpenAI's ``logprobs`` block, built from the sampled ids: pure functions.

``choices[i].logprobs.content`` is a list with one entry per token of the returned
``content``: ``{"token", "logprob", "bytes", "top_logprobs"}``. The rules:

* ``bytes`` are the token's raw UTF-8 bytes, read from the vocabulary (a byte-level
  BPE piece through GPT-2's byte map, a SentencePiece ``<0xNN>`` byte, an added
  token's text), never a decoded string: a character split over two tokens gives each
  token its own bytes, not U+FFFD. ``token`` is those bytes as text, an incomplete
  UTF-8 sequence written with ``\\x`` escapes (as OpenAI does).
* Only the tokens of the content are listed: no entry for the EOS or another special
  token, a reasoning block, a tool call returned in ``tool_calls``, markup dropped from
  the content, or whitespace stripped from its ends. A token that straddles the edge
  of the content is listed with only its bytes inside it. So the bytes of the entries,
  joined, equal the content's UTF-8 exactly; where the model sampled bytes that are not
  valid UTF-8 the content shows U+FFFD and the entries keep the raw bytes (joined, they
  decode to the content).
* ``top_logprobs`` holds the ``k`` most likely tokens at that position (0 <= k <= 20),
  most likely first, each ``{"token", "logprob", "bytes"}`` with the whole token.
* Logprobs are those recorded when sampling (``log_softmax(logits / temperature)``);
  one below :data:`LOGPROB_FLOOR` (or not finite) is reported as the floor, as OpenAI
  reports -9999.0, since JSON has no -inf.

A streamed response gives each content chunk the entries of its own bytes
(:func:`slice_entries`).
"""

from __future__ import annotations

import codecs
import math
import re
import threading
from functools import lru_cache
from typing import Any

from selfrl.chat.toolcall import MARKUP_TAGS

LOGPROB_FLOOR = -9999.0
MAX_TOP_LOGPROBS = 20  # OpenAI's bound
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's map from the printable characters of byte-level BPE pieces back to bytes."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return decoder is not None and "ByteLevel" in repr(decoder)


def token_bytes(tokenizer, ids: list[int]) -> list[bytes]:
    """The raw bytes each of ``ids`` stands for in decoded text; ``b""`` for special tokens,
    except a tag of the call format (``selfrl.chat.toolcall.MARKUP_TAGS``) that the tokenizer
    marks special (Hermes models' ``<tool_call>``): its text, so the call is parsed.

    For a byte-level tokenizer the pieces go through GPT-2's byte map; for a
    SentencePiece tokenizer ``<0xNN>`` is byte NN and ``▁`` a space; an added
    (non-special) token is its own text. Any other tokenizer falls back to the UTF-8
    of ``decode([id])`` (exact except for characters split over tokens).
    """
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    byte_level = _is_byte_level(tokenizer)
    table = _byte_decoder()
    out = []
    for i in ids:
        if i in special or (i in added and getattr(added[i], "special", False)):
            text = str(getattr(added.get(i), "content", ""))
            out.append(text.encode() if text in MARKUP_TAGS else b"")  # a <tool_call> marked special is its text
            continue
        if i in added:
            out.append(str(added[i].content if hasattr(added[i], "content") else added[i]).encode())
            continue
        piece = tokenizer.convert_ids_to_tokens(i)
        if piece is None:
            out.append(b"")
        elif byte_level and all(ch in table for ch in piece):
            out.append(bytes(table[ch] for ch in piece))
        elif (m := _BYTE_PIECE.fullmatch(piece)) is not None:
            out.append(bytes([int(m.group(1), 16)]))
        elif not byte_level and "▁" in piece:
            out.append(piece.replace("▁", " ").encode())
        else:
            out.append(tokenizer.decode([i]).encode())
    return out


def bytes_text(pieces: list[bytes]) -> str:
    """The text of joined token bytes (an invalid sequence becomes U+FFFD)."""
    return b"".join(pieces).decode("utf-8", errors="replace")


_invalid = threading.local()


def _record_invalid(e: UnicodeDecodeError) -> tuple[str, int]:
    _invalid.spans.append((e.start, e.end))
    return "\ufffd", e.end


codecs.register_error("selfrl-offsets", _record_invalid)


def char_offsets(raw: bytes) -> list[int]:
    """``offsets[k]`` is the byte of ``raw`` where character k of ``bytes_text(raw)`` starts
    (``offsets[-1] == len(raw)``), also where an invalid sequence became U+FFFD (the spans
    Python's ``errors="replace"`` replaces, one U+FFFD each).

    >>> char_offsets("你x".encode()), char_offsets(b"\\xec\\xdax"), char_offsets(b"a\\xe4\\xbd")
    ([0, 3, 4], [0, 1, 2, 3], [0, 1, 3])
    """
    _invalid.spans = []
    raw.decode("utf-8", errors="selfrl-offsets")
    starts, p = [], 0
    for start, end in [*_invalid.spans, (len(raw), len(raw))]:
        while p < start:  # valid characters: their length from the lead byte
            starts.append(p)
            lead = raw[p]
            p += 1 if lead < 0x80 else 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
        if start < end:
            starts.append(start)
            p = end
    return starts + [len(raw)]


def char_to_byte_spans(text: str, spans: list[tuple[int, int]], offsets: list[int] | None = None
                       ) -> list[tuple[int, int]]:
    """Character spans of ``text`` as byte spans: of its UTF-8, or of the raw bytes it was
    decoded from when ``offsets`` (:func:`char_offsets`) is given.

    >>> char_to_byte_spans("你好x", [(1, 3)])
    [(3, 7)]
    """
    if offsets is None:
        return [(len(text[:s].encode()), len(text[:e].encode())) for s, e in spans]
    return [(offsets[s], offsets[e]) for s, e in spans]


def _finite(lp: float) -> float:
    return lp if math.isfinite(lp) and lp > LOGPROB_FLOOR else LOGPROB_FLOOR


def _token_text(b: bytes) -> str:
    return b.decode("utf-8", errors="backslashreplace")


def content_entries(pieces: list[bytes], logprobs: list[float], byte_spans: list[tuple[int, int]],
                    top: list[list[tuple[bytes, float]]] | None = None) -> list[dict[str, Any]]:
    """The ``logprobs.content`` entries of the tokens inside ``byte_spans``.

    Args:
        pieces: (n,) each sampled token's bytes (:func:`token_bytes`).
        logprobs: (n,) each sampled token's logprob.
        byte_spans: sorted, disjoint ``[start, end)`` ranges of ``b"".join(pieces)``
            that make up the content.
        top: (n, k) per token, the ``(bytes, logprob)`` of its k most likely
            alternatives; None for no ``top_logprobs`` (each entry then has []).

    Returns:
        entries whose ``bytes`` joined equal the content bytes.

    >>> [e["bytes"] for e in content_entries([b"\\xe4\\xbd", b"\\xa0", b"!"], [-1., -2., -3.], [(0, 3)])]
    [[228, 189], [160]]
    """
    out, off = [], 0
    for n, (b, lp) in enumerate(zip(pieces, logprobs)):
        start, end = off, off + len(b)
        off = end
        kept = b"".join(b[max(start, s) - start:min(end, e) - start] for s, e in byte_spans if max(start, s) < min(end, e))
        if not kept:
            continue
        alts = [] if top is None else [{"token": _token_text(ab), "logprob": _finite(alp), "bytes": list(ab)}
                                       for ab, alp in top[n]]
        out.append({"token": _token_text(kept), "logprob": _finite(lp), "bytes": list(kept), "top_logprobs": alts})
    return out


def slice_entries(entries: list[dict[str, Any]], start: int, end: int) -> list[dict[str, Any]]:
    """The entries covering content bytes ``[start, end)``, a straddling entry cut to its
    bytes inside (used to give each streamed chunk the entries of its own text).

    >>> e = content_entries([b"ab", b"cd"], [-1., -2.], [(0, 4)])
    >>> [x["token"] for x in slice_entries(e, 1, 4)]
    ['b', 'cd']
    """
    out, off = [], 0
    for e in entries:
        b = bytes(e["bytes"])
        lo, hi = max(off, start), min(off + len(b), end)
        if lo < hi:
            part = b[lo - off:hi - off]
            out.append({**e, "token": _token_text(part), "bytes": list(part)})
        off += len(b)
    return out

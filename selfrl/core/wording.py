"""Words in messages: counts (``1 time``, ``2 times``: :func:`plural`) and a client's names
quoted so that two different names never read the same (:func:`shown`, :func:`json_visible`)."""

from __future__ import annotations

import json
import unicodedata


BLANK_LETTERS = frozenset("\u115f\u1160\u3164\uffa0\u2800")
"""Characters that count as printable letters or symbols yet draw nothing (the Hangul fillers,
the blank Braille pattern)."""


def _hidden(c: str) -> bool:
    """Whether ``c`` does not show as a character of its own: a control, format (zero-width
    space, direction marks), private-use or unassigned code point, a separator other than the
    space, a combining mark (which merges into the character before it), a letter that draws
    nothing (:data:`BLANK_LETTERS`), or one that Unicode's composed form (NFC) replaces with
    another (the Kelvin sign with ``K``)."""
    return (not c.isprintable() or unicodedata.combining(c) != 0 or unicodedata.category(c) == "Mn"
            or c in BLANK_LETTERS or unicodedata.normalize("NFC", c) != c)


def json_visible(text: str) -> str:
    r"""``text`` as a JSON string in which every character that does not show on its own
    (:func:`_hidden`) is escaped: ``"é"`` (e and a combining accent) reads apart from
    ``"é"``, and a zero-width space is not an empty string.

    >>> json_visible("météo"), json_visible("me\u0301te\u0301o"), json_visible("\u200b"), json_visible('a\\"')
    ('"météo"', '"me\\u0301te\\u0301o"', '"\\u200b"', '"a\\\\\\""')
    """
    return '"' + "".join(json.dumps(c)[1:-1] if _hidden(c) or c in '"\\' else c for c in text) + '"'


def plain(name: str) -> bool:
    """Whether ``name`` reads as itself: composed (NFC), every character showing on its own."""
    return unicodedata.is_normalized("NFC", name) and not any(_hidden(c) for c in name)


def shown(name: str) -> str:
    r"""A client's ``name`` quoted for a message: ``repr`` (``'get_time'``) when each of its
    characters shows on its own and it is in Unicode's composed form (NFC); else
    :func:`json_visible`, so that a name spelled with a combining accent or an invisible
    character does not read as the name it imitates.

    >>> shown("get_time"), shown("météo"), shown("me\u0301te\u0301o")
    ("'get_time'", "'météo'", '"me\\u0301te\\u0301o"')
    """
    return repr(name) if plain(name) else json_visible(name)


def plural(n: int, word: str, many: str | None = None) -> str:
    """``n`` and ``word``, in the plural unless ``n`` is 1 (``many``: an irregular plural, else ``word + "s"``).

    >>> plural(1, "time"), plural(3, "time"), plural(0, "family", "families")
    ('1 time', '3 times', '0 families')
    """
    return f"{n} {word if n == 1 else (many or word + 's')}"

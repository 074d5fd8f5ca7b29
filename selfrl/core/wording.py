"""Counts in messages: ``1 time``, ``2 times`` (:func:`plural`)."""

from __future__ import annotations


def plural(n: int, word: str, many: str | None = None) -> str:
    """``n`` and ``word``, in the plural unless ``n`` is 1 (``many``: an irregular plural, else ``word + "s"``).

    >>> plural(1, "time"), plural(3, "time"), plural(0, "family", "families")
    ('1 time', '3 times', '0 families')
    """
    return f"{n} {word if n == 1 else (many or word + 's')}"

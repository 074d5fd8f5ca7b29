"""minitext: string helpers for slugs, wrapping and truncation."""

from minitext.format import slugify, truncate, title_case, pad_center
from minitext.wrap import wrap, count_words, longest_word

__all__ = ["slugify", "truncate", "title_case", "pad_center", "wrap", "count_words", "longest_word"]

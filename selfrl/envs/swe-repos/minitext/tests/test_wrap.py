import pytest

from minitext import wrap, count_words, longest_word


def test_wrap():
    assert wrap("the quick brown fox", 10) == ["the quick", "brown fox"]


def test_wrap_exact_width():
    assert wrap("ab cd", 5) == ["ab cd"]


def test_wrap_long_word():
    assert wrap("a verylongword b", 4) == ["a", "verylongword", "b"]


def test_wrap_bad_width():
    with pytest.raises(ValueError):
        wrap("a", 0)


def test_count_words():
    assert count_words(" one two  three ") == 3


def test_longest_word_first_on_tie():
    assert longest_word("cat dog emu") == "cat"


def test_longest_word_empty():
    assert longest_word("   ") is None

import pytest

from minitext import slugify, truncate, title_case, pad_center


def test_slugify():
    assert slugify("Hello, World!") == "hello-world"


def test_slugify_sep():
    assert slugify("  A b  C ", sep="_") == "a_b_c"


def test_slugify_digits():
    assert slugify("Top 10 lists") == "top-10-lists"


def test_truncate_short_text_unchanged():
    assert truncate("short", 5) == "short"


def test_truncate_cuts():
    assert truncate("abcdefghij", 6) == "abc..."


def test_truncate_too_narrow():
    with pytest.raises(ValueError):
        truncate("abc", 2)


def test_title_case():
    assert title_case("the lord of the rings") == "The Lord of the Rings"


def test_pad_center_even():
    assert pad_center("ab", 6, "*") == "**ab**"


def test_pad_center_odd_extra_right():
    assert pad_center("ab", 5, ".") == ".ab.."


def test_pad_center_long():
    assert pad_center("abcdef", 3) == "abcdef"

"""Single-line formatting."""

SMALL_WORDS = {"a", "an", "and", "of", "the", "in", "on", "to"}


def slugify(text, sep="-"):
    """Lower-case words of letters and digits joined by ``sep``."""
    words = []
    current = ""
    for ch in text.lower():
        if ch.isalnum():
            current += ch
        elif current:
            words.append(current)
            current = ""
    if current:
        words.append(current)
    return sep.join(words)


def truncate(text, width, ellipsis="..."):
    """``text`` cut to at most ``width`` characters, ending in ``ellipsis`` when cut."""
    if width < len(ellipsis):
        raise ValueError("width is shorter than the ellipsis")
    if len(text) <= width:
        return text
    return text[: width - len(ellipsis)] + ellipsis


def title_case(text):
    """Capitalize each word except small words that are not first."""
    out = []
    for i, word in enumerate(text.split()):
        if i > 0 and word.lower() in SMALL_WORDS:
            out.append(word.lower())
        else:
            out.append(word[:1].upper() + word[1:].lower())
    return " ".join(out)


def pad_center(text, width, fill=" "):
    """Center ``text`` in ``width`` characters; the extra fill goes to the right."""
    if len(text) >= width:
        return text
    total = width - len(text)
    left = total // 2
    right = total - left
    return fill * left + text + fill * right

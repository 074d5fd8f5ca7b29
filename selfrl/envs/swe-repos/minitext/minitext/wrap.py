"""Multi-word operations."""


def wrap(text, width):
    """Greedy word wrap into lines of at most ``width`` characters (long words stand alone)."""
    if width <= 0:
        raise ValueError("width must be positive")
    lines = []
    line = ""
    for word in text.split():
        if not line:
            line = word
        elif len(line) + 1 + len(word) <= width:
            line += " " + word
        else:
            lines.append(line)
            line = word
    if line:
        lines.append(line)
    return lines


def count_words(text):
    """Number of whitespace-separated words."""
    return len(text.split())


def longest_word(text):
    """The longest word; the first one on a tie; None for no words."""
    best = None
    for word in text.split():
        if best is None or len(word) > len(best):
            best = word
    return best

"""Title case with small words kept lower case."""

SMALL_WORDS = {"a", "an", "and", "of", "the", "in", "on", "to"}


def title_case(text: str) -> str:
    words = text.lower().split()
    return " ".join(word if word in SMALL_WORDS else word.capitalize() for word in words)

"""URL slugs from titles."""

import re

_UNSAFE = re.compile(r"[^a-z0-9 ]")


def slugify(title: str) -> str:
    """Lower-case words of `title` joined by hyphens; other characters dropped."""
    cleaned = _UNSAFE.sub("", title.lower())
    return "-".join(cleaned.split())

"""Durations like "1h30m" in seconds."""

import re

_PART = re.compile(r"(\d+)([hms])")
_SECONDS = {"h": 60, "m": 60, "s": 1}


def parse_duration(text: str) -> int:
    parts = _PART.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a duration: {text!r}")
    return sum(int(number) * _SECONDS[unit] for number, unit in parts)

"""Integers as Roman numerals."""

_SYMBOLS = [
    (1000, "M"),
    (500, "D"),
    (100, "C"),
    (50, "L"),
    (10, "X"),
    (5, "V"),
    (1, "I"),
]


def to_roman(number: int) -> str:
    """`number` (1 to 3999) in Roman numerals."""
    if not 0 < number < 4000:
        raise ValueError(f"{number} is out of range (1 to 3999)")
    digits = []
    for value, symbol in _SYMBOLS:
        count, number = divmod(number, value)
        digits.append(symbol * count)
    return "".join(digits)

"""Integers as Roman numerals."""

_SYMBOLS = [
    (1000, "M"),
    (900, "CM"),
    (500, "D"),
    (400, "CD"),
    (100, "C"),
    (90, "XC"),
    (50, "L"),
    (40, "XL"),
    (10, "X"),
    (9, "IX"),
    (5, "V"),
    (4, "IV"),
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

import pytest

from roman.numerals import to_roman


def test_small_numbers():
    assert to_roman(1) == "I"
    assert to_roman(3) == "III"


def test_tens():
    assert to_roman(20) == "XX"


def test_out_of_range():
    with pytest.raises(ValueError):
        to_roman(0)


@pytest.mark.parametrize("number, expected", [(4, "IV"), (9, "IX"), (1994, "MCMXCIV")])
def test_subtractive_pairs(number, expected):
    assert to_roman(number) == expected

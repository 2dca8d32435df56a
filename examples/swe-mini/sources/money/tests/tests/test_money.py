from ledger.money import format_cents


def test_whole_cents():
    assert format_cents(1234) == "$12.34"


def test_small_cents_are_padded():
    assert format_cents(1205) == "$12.05"


def test_negative_amounts():
    assert format_cents(-250) == "-$2.50"

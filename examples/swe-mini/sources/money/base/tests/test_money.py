from ledger.money import format_cents


def test_whole_cents():
    assert format_cents(1234) == "$12.34"

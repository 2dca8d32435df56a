from units.temperature import celsius_to_fahrenheit, fahrenheit_to_celsius


def test_celsius_to_fahrenheit():
    assert celsius_to_fahrenheit(100) == 212


def test_freezing_point():
    assert fahrenheit_to_celsius(32) == 0


def test_boiling_point():
    assert fahrenheit_to_celsius(212) == 100


def test_round_trip():
    assert round(fahrenheit_to_celsius(celsius_to_fahrenheit(37.5)), 9) == 37.5

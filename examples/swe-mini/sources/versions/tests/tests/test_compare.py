from semver_lite.compare import compare


def test_equal():
    assert compare("1.2", "1.2") == 0


def test_simple_order():
    assert compare("1.2", "1.3") == -1
    assert compare("2.0", "1.9") == 1


def test_numeric_parts():
    assert compare("1.10", "1.9") == 1


def test_missing_parts_are_zero():
    assert compare("1.0", "1") == 0

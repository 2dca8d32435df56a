from nesting.flat import flatten


def test_one_level():
    assert flatten([1, [2, 3]]) == [1, 2, 3]


def test_strings_stay_whole():
    assert flatten(["ab", ["cd"]]) == ["ab", "cd"]

from binning.histogram import histogram


def test_counts():
    assert histogram([1, 2, 6], bins=2, low=0, high=10) == [2, 1]


def test_out_of_range_values_are_ignored():
    assert histogram([-1, 11, 3], bins=2, low=0, high=10) == [1, 0]

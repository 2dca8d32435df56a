from ranges.merge import merge_intervals


def test_overlapping():
    assert merge_intervals([(1, 5), (3, 7)]) == [(1, 7)]


def test_disjoint_and_unsorted():
    assert merge_intervals([(5, 6), (1, 2)]) == [(1, 2), (5, 6)]


def test_touching_intervals_merge():
    assert merge_intervals([(1, 2), (2, 3)]) == [(1, 3)]

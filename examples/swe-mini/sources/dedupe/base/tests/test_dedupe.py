from uniq.dedupe import unique


def test_removes_duplicates():
    assert len(unique(["a", "b", "a"])) == 2


def test_empty():
    assert unique([]) == []

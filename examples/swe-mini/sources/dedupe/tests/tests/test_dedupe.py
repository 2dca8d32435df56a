from uniq.dedupe import unique


def test_removes_duplicates():
    assert len(unique(["a", "b", "a"])) == 2


def test_empty():
    assert unique([]) == []


def test_keeps_first_occurrence_order():
    assert unique(["b", "a", "b", "c"]) == ["b", "a", "c"]

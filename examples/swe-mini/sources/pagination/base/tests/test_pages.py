from paging.pages import page, page_count


def test_full_pages():
    assert page_count(10, per_page=5) == 2


def test_page_slice():
    assert page(list(range(10)), 2, per_page=3) == [3, 4, 5]

"""Splitting result lists into pages."""


def page_count(total: int, per_page: int) -> int:
    if per_page < 1:
        raise ValueError("per_page must be at least 1")
    return -(-total // per_page)


def page(items, number, per_page):
    start = (number - 1) * per_page
    return items[start : start + per_page]

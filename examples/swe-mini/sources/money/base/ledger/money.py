"""Formatting amounts of money held in cents."""


def format_cents(cents: int) -> str:
    dollars, rest = divmod(cents, 100)
    return f"${dollars}.{rest}"

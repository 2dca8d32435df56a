"""Converting identifiers between naming styles."""


def snake_to_camel(name: str) -> str:
    first, *rest = name.split("_")
    return first + "".join(part[0].upper() + part[1:] for part in rest if part)


def camel_to_snake(name: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in name)

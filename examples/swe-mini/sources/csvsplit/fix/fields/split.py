"""Splitting one line of comma-separated fields."""


def split_fields(line: str) -> list:
    fields, current, quoted = [], [], False
    for char in line:
        if char == '"':
            quoted = not quoted
        elif char == "," and not quoted:
            fields.append("".join(current))
            current = []
        else:
            current.append(char)
    fields.append("".join(current))
    return fields

"""Run-length encoding of strings."""


def encode(text: str) -> str:
    if not text:
        return ""
    pieces = []
    current, count = text[0], 0
    for char in text:
        if char == current:
            count += 1
        else:
            pieces.append(f"{current}{count}")
            current, count = char, 1
    pieces.append(f"{current}{count}")
    return "".join(pieces)

"""The Caesar cipher."""


def shift(text: str, places: int) -> str:
    out = []
    for char in text:
        if char.isalpha():
            out.append(chr(ord(char) + places))
        else:
            out.append(char)
    return "".join(out)

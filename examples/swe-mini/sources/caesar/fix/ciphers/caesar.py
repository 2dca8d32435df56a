"""The Caesar cipher."""


def shift(text: str, places: int) -> str:
    out = []
    for char in text:
        if char.isalpha():
            base = ord("a") if char.islower() else ord("A")
            out.append(chr(base + (ord(char) - base + places) % 26))
        else:
            out.append(char)
    return "".join(out)

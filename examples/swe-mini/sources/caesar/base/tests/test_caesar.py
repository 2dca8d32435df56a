from ciphers.caesar import shift


def test_shift_inside_the_alphabet():
    assert shift("abc", 1) == "bcd"


def test_keeps_punctuation():
    assert shift("a b!", 1) == "b c!"

from fizzbuzz import fizzbuzz


def test_plain_numbers():
    assert [fizzbuzz(n) for n in (1, 2, 4, 7)] == ["1", "2", "4", "7"]


def test_multiples_of_three_or_five():
    assert [fizzbuzz(n) for n in (3, 5, 9, 10)] == ["Fizz", "Buzz", "Fizz", "Buzz"]


def test_multiples_of_fifteen():
    assert [fizzbuzz(n) for n in (15, 30, 45)] == ["FizzBuzz"] * 3

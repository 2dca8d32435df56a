import pytest

from containers.stack import EmptyStackError, Stack


def test_push_pop():
    stack = Stack()
    stack.push(1)
    stack.push(2)
    assert stack.pop() == 2
    assert len(stack) == 1


def test_peek_empty():
    with pytest.raises(EmptyStackError):
        Stack().peek()


def test_pop_empty():
    with pytest.raises(EmptyStackError):
        Stack().pop()

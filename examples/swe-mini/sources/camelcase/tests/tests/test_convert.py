from casing.convert import camel_to_snake, snake_to_camel


def test_snake_to_camel():
    assert snake_to_camel("max_value") == "maxValue"


def test_camel_to_snake():
    assert camel_to_snake("maxValue") == "max_value"


def test_double_underscore():
    assert snake_to_camel("max__value") == "maxValue"

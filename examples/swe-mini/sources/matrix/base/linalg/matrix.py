"""Small dense matrices as lists of rows."""


def transpose(matrix):
    size = len(matrix)
    return [[matrix[row][column] for row in range(size)] for column in range(size)]


def identity(n):
    return [[1 if i == j else 0 for j in range(n)] for i in range(n)]

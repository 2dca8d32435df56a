"""Small dense matrices as lists of rows."""


def transpose(matrix):
    if not matrix:
        return []
    return [[row[column] for row in matrix] for column in range(len(matrix[0]))]


def identity(n):
    return [[1 if i == j else 0 for j in range(n)] for i in range(n)]

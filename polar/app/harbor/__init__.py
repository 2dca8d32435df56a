"""Harbor task directories: imported as Polar tasks (tasks.py), graded by their tests/test.sh in a
fresh container (evaluator.py), checked by their solution (oracle.py)."""

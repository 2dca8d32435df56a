"""Polar's tests: a package, so that every test imports its helpers as `tests.helpers.…` (pyproject's
pytest `pythonpath` puts the repository root on the path; nothing else edits it)."""

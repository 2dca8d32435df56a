#!/bin/bash
# The reward: 1 when the tests of test_fizzbuzz.py pass against /app/fizzbuzz.py, else 0.
mkdir -p /logs/verifier
cd /app
if PYTHONPATH=/app python3 -m pytest -q -p no:cacheprovider /tests/test_fizzbuzz.py; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi

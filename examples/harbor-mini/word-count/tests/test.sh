#!/bin/bash
# The reward: 1 when /app/count.txt holds the word count of /app/poem.txt, else 0.
mkdir -p /logs/verifier
expected=$(wc -w < /app/poem.txt)
if [ -f /app/count.txt ] && [ "$(tr -d ' \n' < /app/count.txt)" = "$expected" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo "count.txt: expected $expected"
    echo 0 > /logs/verifier/reward.txt
fi

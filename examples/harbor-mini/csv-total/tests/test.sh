#!/bin/bash
# The reward, written as reward.json: 1 when /app/total.json's total is the amounts' sum (within
# $TOLERANCE), else 0.
mkdir -p /logs/verifier
python3 - <<'PY'
import csv, json, os

expected = sum(float(row["amount"]) for row in csv.DictReader(open("/app/sales.csv")))
try:
    total = float(json.load(open("/app/total.json"))["total"])
    reward = 1.0 if abs(total - expected) <= float(os.environ["TOLERANCE"]) else 0.0
except (OSError, ValueError, KeyError, TypeError) as exc:
    print(f"total.json: {exc}")
    reward = 0.0
json.dump({"reward": reward}, open("/logs/verifier/reward.json", "w"))
PY

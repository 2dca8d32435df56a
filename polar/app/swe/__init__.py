"""SWE-style repository tasks: dataset instances imported as tasks (instances.py), the agent's
change read from its workspace (changes.py), test logs graded (grading.py), the "swe" evaluator
(evaluator.py) and `polar tasks oracle` (oracle.py)."""

"""Offline data generation: rejection sampling over rollouts (run.py, plan.py) and the SFT export of
what was kept (export.py)."""

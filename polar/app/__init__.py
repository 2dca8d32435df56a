"""The top layer: what assembles the services into runs. The `polar` command (cli.py), `polar up`'s
stack (stack.py), training and generation runs (train.py, generate/), the gateway node that hosts a
gateway and runs sessions (node/), and SWE-style task sources and grading (swe/).

Nothing below this package imports it: see docs/architecture.md for the layering rule.
"""

"""The gateway node: the side of the rollout that runs sessions. The node (node.py) hosts a gateway
and runs each session through its pools (pools.py): a runtime (runtimes/, sandboxed by isolation.py
and sandbox.py), the harness (run by process.py), an evaluator (evaluators.py), then the trajectory
builder."""

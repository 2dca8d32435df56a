"""Rollouts: tasks in, sessions run by gateway nodes, complete GRPO groups of trajectories out.

The rollout server (server.py, over the SQLite store in store.py) takes tasks (tasks.py), dispatches
their sessions to nodes through long-polled heartbeats, and releases each task's group once every
session is done. A node (node.py) runs each session through its pools (pools.py): a runtime
(runtimes/), a harness (harness.py, run by process.py), an evaluator (evaluators.py), and the
trajectory builder.
"""

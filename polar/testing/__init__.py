"""Fakes for tests that use Polar, ours and yours: a running gateway over the scripted engine
(gateway.py), a whole rollout stack on loopback ports (rollout.py), a fake upstream inference server
(upstream.py) and generated call records (trajectories.py).

No production module imports this package.
"""

"""Loaded at start-up by every Python process whose PYTHONPATH holds this folder: the vLLM tier's
shared engine (tests/integration/conftest.py) puts it there so that vLLM's engine core, a spawned
process, gets a grammar library that fails on demand, for the dead-end test.

With POLAR_TEST_DEAD_END_FILE set to a path: while that file exists and holds a number N, every
grammar that fills a mask is failed, from its (N+1)th mask on (counted from the first it filled
while the file existed), with a mask that allows no token at all. Unset, or while the file is
absent, nothing changes."""

import os

_SWITCH = os.environ.get("POLAR_TEST_DEAD_END_FILE")

if _SWITCH:
    import llguidance.torch

    _real_fill = llguidance.torch.fill_next_token_bitmask
    # id(matcher) -> [matcher, masks filled, healthy masks]; the matcher is held so that its id
    # is not handed to a later matcher while the entry lasts.
    _failing: dict[int, list] = {}

    def _healthy_masks() -> int | None:
        try:
            with open(_SWITCH) as switch:
                return int(switch.read())
        except FileNotFoundError:
            return None

    def _fill_then_fail(matcher, bitmask, index=0):
        _real_fill(matcher, bitmask, index)
        entry = _failing.get(id(matcher))
        if entry is None:
            healthy = _healthy_masks()
            if healthy is None:
                return
            entry = _failing[id(matcher)] = [matcher, 0, healthy]
        entry[1] += 1
        if entry[1] > entry[2]:
            bitmask[index].zero_()

    llguidance.torch.fill_next_token_bitmask = _fill_then_fail

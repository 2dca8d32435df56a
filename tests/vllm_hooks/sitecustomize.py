"""Loaded at start-up by every Python process whose PYTHONPATH holds this folder: the vLLM tier's
dead-end test puts it there so that vLLM's engine core, a spawned process, gets a failing grammar
library. With POLAR_TEST_MASKS_BEFORE_DEAD_END=N, llguidance's mask of each matcher allows no token
at all from the (N+1)th mask on; unset, nothing changes."""

import os

_HEALTHY_MASKS = os.environ.get("POLAR_TEST_MASKS_BEFORE_DEAD_END")

if _HEALTHY_MASKS:
    from collections import Counter

    import llguidance.torch

    _real_fill = llguidance.torch.fill_next_token_bitmask
    _masks: Counter = Counter()

    def _fill_then_fail(matcher, bitmask, index=0):
        _real_fill(matcher, bitmask, index)
        _masks[id(matcher)] += 1
        if _masks[id(matcher)] > int(_HEALTHY_MASKS):
            bitmask[index].zero_()

    llguidance.torch.fill_next_token_bitmask = _fill_then_fail

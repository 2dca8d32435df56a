"""Settings for every test tier.

Hypothesis: in CI (CI=true) every property test draws the same examples on every run and has no
per-example deadline, so a 2-core machine under load cannot fail a run on a slow example or a lucky
draw; locally, each run explores fresh examples. The vLLM tier's environment has no Hypothesis (none
of its tests use it), hence the guarded import.
"""

from __future__ import annotations

import importlib.util
import os

if importlib.util.find_spec("hypothesis") is not None:
    from hypothesis import settings

    settings.register_profile("ci", derandomize=True, deadline=None, database=None)
    if os.environ.get("CI") == "true":
        settings.load_profile("ci")

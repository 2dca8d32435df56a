"""Polar: reinforcement learning for unmodified language agents."""

__version__ = "0.1.0"

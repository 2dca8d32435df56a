"""Backends behind the trainer's one contract (base.py): torch, and megatron where installed."""

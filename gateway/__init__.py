"""Polar's gateway: serves the model to unmodified harnesses in their own dialects, recording every token."""

"""Polar's gateway: serves the model to unmodified harnesses in their own API dialects and records every sampled token."""

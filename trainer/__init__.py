"""The GRPO trainer: the loss math, micro-batch layouts, backends and the training loop."""

"""Models the `train` command trains: the tiny Megatron-Core GPT (loop and V layouts)."""

"""The policy model: loading it with its LoRA adapter, where it runs, and its products."""

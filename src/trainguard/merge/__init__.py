"""Reading sharded checkpoints of every kind as full tensors: merge to Hugging Face, compare, convert."""

"""`colibri-stream convert`: Hugging Face checkpoints read shard by shard and written as expert containers."""

"""Hugging Face model directories: checking them (config), loading them shard by shard (init), converting them (convert)."""

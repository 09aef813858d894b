"""The reference trainer: any Hugging Face causal LM built from a config, FSDP2/HSDP/TP."""

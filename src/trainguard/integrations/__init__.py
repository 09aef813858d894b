"""Adapters for training loops users already run: ``hf_trainer`` (Hugging Face ``Trainer``; needs the
``hf`` extra, accelerate), and the torchtitan recipe in docs/library.md. Each is a thin user of
``trainguard.Guard``."""

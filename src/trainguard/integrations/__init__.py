"""Adapters for training loops users already run: ``hf_trainer`` (Hugging Face ``Trainer``; needs the
``hf`` extra, accelerate) and ``torchtitan`` (its optimizer and LR scheduler containers). Each is a thin user of
``trainguard.Guard``."""

"""One pipeline stage's forward (``PipelineStageModule``) on the installed transformers: the logits of
the whole model, and no FutureWarning. It passed ``past_key_values=None`` to ``create_causal_mask``,
which transformers renamed ``cache``: config.md's reference-keys example (``parallel_config:
{pipeline_stage: 2}``) printed "`past_key_values` is deprecated" from every rank."""

from __future__ import annotations

import copy
import warnings

import torch

from trainguard.config.schema import ModelConfig
from trainguard.trainer.model import build_model, build_model_config
from trainguard.trainer.pipeline import PipelineStageModule, prune_to_stage


def test_a_single_stage_gives_the_models_logits_without_a_future_warning():
    config = build_model_config(ModelConfig(preset="llama-micro", tie_word_embeddings=False), 16)
    model = build_model(config, seed=0)
    stage_model = copy.deepcopy(model)
    stage = PipelineStageModule(stage_model, 0, 1, prune_to_stage(stage_model, 0, 1))
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        logits = stage(tokens)
    torch.testing.assert_close(logits, model(input_ids=tokens).logits, rtol=0, atol=0)

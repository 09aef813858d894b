"""What GPT-2 (``GPT2LMHeadModel``, ``model_type: gpt2``) does otherwise than the Llama layout, for the code
that handles both (``hf.model_types`` dispatches on the model type; the merge names its input embedding).

GPT-2's modules sit under ``transformer.``: ``wte`` (the input embedding, which ``lm_head`` shares unless
``tie_word_embeddings`` is false; ``save_pretrained`` writes it once), ``wpe`` (one learned embedding per
position, so a sequence may be at most ``n_positions`` long), blocks ``h.N.{ln_1, attn.c_attn, attn.c_proj,
ln_2, mlp.c_fc, mlp.c_proj}`` and ``ln_f``. Its projections are ``Conv1D`` modules whose weights are stored
``[in, out]`` (transposed against ``nn.Linear``), with q, k and v fused in one ``c_attn``. Its config names
the sizes ``n_embd``, ``n_layer``, ``n_head`` (the ``attribute_map`` answers to ``hidden_size`` and the
like), the MLP's width ``n_inner`` (None: 4 × ``n_embd``), and has no ``num_key_value_heads``.
Nothing here imports transformers (the merge must not pay for it).
"""

from __future__ import annotations

from typing import Any

MODEL_TYPE = "gpt2"
INPUT_EMBEDDING = "transformer.wte.weight"

# trainguard's model.<key> -> GPT-2's config name, where it differs from hf.config.MODEL_KEYS;
# None: GPT-2 has no such setting (its attention has as many key/value heads as heads)
KEY_NAMES: dict[str, str | None] = {"num_kv_heads": None, "intermediate_size": "n_inner"}

# parallel.<key> -> why the reference trainer cannot split GPT-2 that way (FSDP2 / HSDP only)
UNSUPPORTED_PARALLEL = {
    "tp": "its q, k and v are fused in one Conv1D, c_attn, whose weight is stored [in, out], and torch's "
          "ColwiseParallel/RowwiseParallel split nn.Linear only",
    "pp": "the pipeline stages are built for the Llama layout, model.layers with rotary positions, not for "
          "GPT-2's transformer.h with learned positions",
}


def config_value(config: Any, name: str) -> Any:
    """``config.<name>``, with ``n_inner``'s None read as the width it means (4 × ``n_embd``)."""
    value = getattr(config, name)
    if name == "n_inner" and value is None:
        return 4 * config.n_embd
    return value

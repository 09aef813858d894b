"""The reference trainer's named model sizes (``model.preset``): Hugging Face config values of the
preset's ``model_type`` (Llama when it names none)."""

from __future__ import annotations

# vocab_size is padded past the byte tokenizer's 259 ids so it splits evenly across shards.
PRESETS: dict[str, dict] = {
    # for tests: fast on two CPU cores
    "llama-micro": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=160, vocab_size=320, tie_word_embeddings=True),
    # Qwen2 (q/k/v biases, tied embeddings like its small sizes), for tests
    "qwen2-micro": dict(model_type="qwen2", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=160, vocab_size=320, tie_word_embeddings=True),
    # Mistral (the Llama layout, untied embeddings like its released sizes), for tests
    "mistral-micro": dict(model_type="mistral", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, intermediate_size=160, vocab_size=320, tie_word_embeddings=False),
    # Mixtral (4 experts, top-2; fused expert parameters in memory), for tests
    "mixtral-micro": dict(model_type="mixtral", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, intermediate_size=96, num_local_experts=4,
                          num_experts_per_tok=2, vocab_size=320, tie_word_embeddings=False),
    # Qwen2-MoE (4 routed experts, top-2, and a shared expert with its gate), for tests
    "qwen2-moe-micro": dict(model_type="qwen2_moe", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=160, moe_intermediate_size=48,
                            shared_expert_intermediate_size=96, num_experts=4, num_experts_per_tok=2,
                            vocab_size=320, tie_word_embeddings=False),
    # the default: a few million parameters
    "llama-tiny": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                       intermediate_size=688, vocab_size=320, tie_word_embeddings=True),
    # for benchmarks: about 60M parameters
    "llama-60m": dict(hidden_size=768, num_hidden_layers=10, num_attention_heads=12, num_key_value_heads=4,
                      intermediate_size=2048, vocab_size=320, tie_word_embeddings=True),
    # GPT-2 (fused c_attn, Conv1D weights, LayerNorm with bias, learned positions: n_positions is
    # data.seq_len), for tests; dropout 0 (GPT-2's default is 0.1) so runs agree across layouts
    "gpt2-micro": dict(model_type="gpt2", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                       vocab_size=320, tie_word_embeddings=True, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
}

"""Tiny configs of the supported families, shared by the tests (no torch import here)."""

COMMON = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    pad_token_id=0,
)

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 8, "final_logit_softcapping": 30.0}),
}


# Families with mini_sequence_chunk only (5.24.0+mst.9): tests/test_new_families.py. Not in FAMILIES, whose
# parametrized tests (streaming, memory, planner) cover the four families with every path.
NEW_FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"bos_token_id": 1, "eos_token_id": 2}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {"eos_token_id": 2}),
    # A sliding window (8) shorter than the test sequences, on one layer of two; a softcap (2.0) that bends the
    # tiny logits (at 30 a softcap left out of the chunked loss moved the gradients by only ~3e-5).
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "head_dim": 8, "final_logit_softcapping": 2.0, "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"],
    }),
    # MoE: 4 experts, top-2; the auxiliary loss weighted 1.0 so that its gradient counts in the comparisons.
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {
        "num_local_experts": 4, "num_experts_per_tok": 2, "router_aux_loss_coef": 1.0,
    }),
    # Layer 0 dense (Qwen3MoeMLP), layer 1 sparse.
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
        "norm_topk_prob": True, "mlp_only_layers": [0], "router_aux_loss_coef": 1.0,
    }),
    # Alternating sliding (window 8) and full attention layers, attention sinks.
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", {
        "head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8,
        "router_aux_loss_coef": 1.0,
    }),
}
MOE_FAMILIES = ("mixtral", "qwen3_moe", "gpt_oss")


# State-space families (adjoint sharding): their own common sizes.
SSM_COMMON = dict(vocab_size=128, hidden_size=32, state_size=8, expand=2, num_hidden_layers=2, pad_token_id=0)
SSM_FAMILIES = {
    "mamba": ("MambaConfig", "MambaForCausalLM", {}),
    "falcon_mamba": ("FalconMambaConfig", "FalconMambaForCausalLM", {}),
}


def _entry(family):
    if family in SSM_FAMILIES:
        return SSM_COMMON, SSM_FAMILIES[family]
    if family in NEW_FAMILIES:
        return COMMON, NEW_FAMILIES[family]
    return COMMON, FAMILIES[family]


def make_config(family, **overrides):
    import transformers

    common, (config_name, _, extra) = _entry(family)
    return getattr(transformers, config_name)(**{**common, **extra, **overrides})


def make_model(family, seed=0, **overrides):
    import torch
    import transformers

    _, (_, model_name, _) = _entry(family)
    torch.manual_seed(seed)
    return getattr(transformers, model_name)(make_config(family, **overrides))

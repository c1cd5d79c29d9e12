"""Tiny configs of the four supported families, shared by the tests (no torch import here)."""

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


# State-space families (adjoint sharding, issue 9): their own common sizes.
SSM_COMMON = dict(vocab_size=128, hidden_size=32, state_size=8, expand=2, num_hidden_layers=2, pad_token_id=0)
SSM_FAMILIES = {
    "mamba": ("MambaConfig", "MambaForCausalLM", {}),
    "falcon_mamba": ("FalconMambaConfig", "FalconMambaForCausalLM", {}),
}


def _entry(family):
    if family in SSM_FAMILIES:
        return SSM_COMMON, SSM_FAMILIES[family]
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

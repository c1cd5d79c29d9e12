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


def make_config(family, **overrides):
    import transformers

    config_name, _, extra = FAMILIES[family]
    return getattr(transformers, config_name)(**{**COMMON, **extra, **overrides})


def make_model(family, seed=0, **overrides):
    import torch
    import transformers

    _, model_name, _ = FAMILIES[family]
    torch.manual_seed(seed)
    return getattr(transformers, model_name)(make_config(family, **overrides))

"""The model families transformers-mst has a path for: one entry per `model_type`.

Read by the model checks (`model_checks.py`: which field applies where), the generic streamed layer (which families it
streams), Ulysses (whose masks it can rebuild) and the README's support matrix (`support_matrix()`, compared with
README.md by tests/test_families.py). Imports nothing: model_checks.py, which reads it, is imported by configuration_utils.
"""

from typing import NamedTuple


class Family(NamedTuple):
    name: str  # as the README names it
    # What mini_sequence_chunk chunks: "mlp" (MLP, final norm, LM head + loss), "moe" (the same with MoE blocks by
    # token chunks), "lm_head" (LM head + loss only: state-space models), "text_config" (a composite whose text
    # config carries the field), or None.
    mini_sequence: str | None
    # Attention implementations streaming_backward_chunk streams this family's decoder layers with (tested: the
    # layer's own forward per query chunk, streaming_backward/); () where the field is not supported.
    streaming_attention: tuple = ()
    no_streaming: str = "ignored"  # the README's word where streaming_attention is ()
    ulysses: bool = False  # Ulysses rebuilds this family's whole-sequence masks exactly
    adjoint: bool = False  # adjoint_sharding_chunk / adjoint_truncation


_ATTENTION = ("sdpa", "eager", "flash_attention_2")

FAMILIES = {
    "llama": Family("Llama", "mlp", _ATTENTION, ulysses=True),
    "qwen2": Family("Qwen2", "mlp", _ATTENTION, ulysses=True),
    "mistral": Family("Mistral", "mlp", _ATTENTION, ulysses=True),
    # Gemma-2's softcapped attention has no SDPA path upstream.
    "gemma2": Family("Gemma-2", "mlp", ("eager", "flash_attention_2"), ulysses=True),
    "qwen3": Family("Qwen3", "mlp", _ATTENTION, ulysses=True),
    "phi3": Family("Phi-3", "mlp", _ATTENTION, ulysses=True),
    "olmo2": Family("OLMo-2", "mlp", _ATTENTION),
    "gemma3_text": Family("Gemma-3 text", "mlp", _ATTENTION, ulysses=True),
    "mixtral": Family("Mixtral", "moe", _ATTENTION),
    "qwen3_moe": Family("Qwen3-MoE", "moe", _ATTENTION),
    # GPT-OSS: sinks; upstream has no SDPA path, and its FlashAttention needs a kernel with sinks (not flash-attn).
    "gpt_oss": Family("GPT-OSS", "moe", ("eager",)),
    "gemma3": Family("Gemma-3 multimodal", "text_config", no_streaming="not tried"),
    "mamba": Family("Mamba", "lm_head", adjoint=True),
    "falcon_mamba": Family("FalconMamba", "lm_head", adjoint=True),
}


def streaming_model_types() -> tuple:
    """The model types streaming_backward_chunk streams."""
    return tuple(t for t, family in FAMILIES.items() if family.streaming_attention)


def model_types(**wanted) -> tuple:
    """The model types whose entry has every given value, e.g. `model_types(ulysses=True)`; a tuple value means any
    of its members (`model_types(mini_sequence=("mlp", "moe"))`)."""

    def matches(family, key, value):
        return getattr(family, key) in value if isinstance(value, tuple) else getattr(family, key) == value

    return tuple(t for t, family in FAMILIES.items() if all(matches(family, k, v) for k, v in wanted.items()))


_MINI_SEQUENCE_CELLS = {
    "mlp": "yes",
    "moe": "yes, MoE blocks (router aux loss exact)",
    "lm_head": "LM head + loss",
    "text_config": "on `text_config`: text MLP and the composite's LM head + loss",
    None: "ignored",
}


def _cells(family: Family) -> tuple:
    streaming = f"yes: {', '.join(family.streaming_attention)}" if family.streaming_attention else family.no_streaming
    return _MINI_SEQUENCE_CELLS[family.mini_sequence], streaming, "yes" if family.adjoint else "ignored"


def support_matrix() -> str:
    """The README's table: one row per run of consecutive families with the same cells."""
    rows = []
    for model_type, family in FAMILIES.items():
        cells = _cells(family)
        if rows and rows[-1][1] == cells:
            rows[-1][0].append((family.name, model_type))
        else:
            rows.append(([(family.name, model_type)], cells))
    lines = [
        "| family (`model_type`) | `mini_sequence_chunk` | `streaming_backward_chunk` | adjoint fields |",
        "|---|---|---|---|",
    ]
    for members, cells in rows:
        names = ", ".join(name for name, _ in members)
        types = ", ".join(f"`{t}`" for _, t in members)
        lines.append(f"| {names} ({types}) | " + " | ".join(cells) + " |")
    lines.append("| any other model type | ignored (warned) | ignored (warned) | ignored (warned) |")
    return "\n".join(lines)

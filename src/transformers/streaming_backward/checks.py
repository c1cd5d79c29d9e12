"""What a streamed layer refuses, with the reason and what is allowed, before it computes anything (layer.py)."""

import torch

from ..mst_core.fields import STREAMING_FIELD
from .masks import masks_offset_chunk_itself
from .parts import attention_module
from .router import HANDLED_OUTPUTS


FLASH_ATTENTION = "flash_attention_2"
SUPPORTED_ATTENTION = ("sdpa", "eager", FLASH_ATTENTION)


def check_attention_call(layer, mask, batch: int, seq_len: int) -> bool:
    """Raise unless the layer's attention can run offset query chunks with this mask; returns whether its
    attention function masks an offset chunk itself (masks.masks_offset_chunk_itself)."""
    attn = attention_module(layer)
    config = attn.config
    implementation = config._attn_implementation
    bottom_right = implementation not in SUPPORTED_ATTENTION and masks_offset_chunk_itself(implementation)
    if implementation not in SUPPORTED_ATTENTION and not bottom_right:
        raise ValueError(
            f"{STREAMING_FIELD} is set but {type(layer).__name__} uses attn_implementation={implementation!r}; "
            f"the streamed layer runs offset query chunks only with {SUPPORTED_ATTENTION}. Load the model with one "
            "of them, or unset the field."
        )
    if not getattr(attn, "is_causal", True):
        raise ValueError(
            f"{STREAMING_FIELD} needs causal attention (each query chunk reads only earlier keys); "
            f"{type(attn).__name__} is bidirectional here. Unset the field."
        )
    if implementation == FLASH_ATTENTION:
        from ..modeling_flash_attention_utils import flash_attn_supports_top_left_mask

        if flash_attn_supports_top_left_mask():
            raise ValueError(
                f"{STREAMING_FIELD}: the installed flash-attn aligns its causal mask top-left (before 2.1), "
                "which masks every query chunk after the first wrongly. Install flash-attn >= 2.1, or use "
                "attn_implementation='sdpa'."
            )
        # FlashAttention gets the [batch, key] padding mask (or none) and unpads by it, as upstream does.
        if mask is not None and (not isinstance(mask, torch.Tensor) or tuple(mask.shape) != (batch, seq_len)):
            raise ValueError(
                f"{STREAMING_FIELD}: with {FLASH_ATTENTION} the decoder layer got an attention mask of shape "
                f"{getattr(mask, 'shape', None)}; streaming slices a [batch, {seq_len}] padding mask per chunk "
                "and supports no other kind (a KV cache or prefix is not supported)."
            )
    elif mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
            raise ValueError(
                f"{STREAMING_FIELD}: the decoder layer got an attention mask of type {type(mask).__name__} "
                f"(shape {getattr(mask, 'shape', None)}); streaming slices a 4D [batch, 1, query, key] mask per "
                "chunk and supports no other kind."
            )
        if tuple(mask.shape[-2:]) != (seq_len, seq_len):
            raise ValueError(
                f"{STREAMING_FIELD}: the 4D attention mask covers {tuple(mask.shape[-2:])} (query, key) "
                f"positions for a sequence of {seq_len}; a KV cache or prefix is not supported."
            )
    elif implementation == "eager":
        raise ValueError(f"{STREAMING_FIELD}: eager attention was called without a mask (bidirectional).")
    return bottom_right


def check_cache_is_empty(layer, cache) -> None:
    """A streamed layer neither reads nor fills the cache, as under upstream's gradient checkpointing, which streaming
    replaces: a training forward with the default `use_cache=True` returns the (empty) cache the model made, without
    the whole sequence's keys and values (their memory is what streaming saves). Cached tokens from an earlier call
    would be silently not attended to: refused."""
    cached = cache.get_seq_length(attention_module(layer).layer_idx) if cache is not None else 0
    if cached:
        raise ValueError(
            f"{STREAMING_FIELD}: the cache passed (`cache` / `past_key_values`) holds {cached} cached tokens, "
            "which a streamed layer cannot attend to (streamed training forwards neither read nor fill a cache). "
            "Train without a cache, or unset the field."
        )


def check_captured_outputs(layer, collector) -> None:
    """Outputs that transformers captures inside the layer (attentions: hooks on submodules) would be captured once per
    chunk, without graph: refused. Hidden states are captured around the layer, MoE router logits by router.py: fine.
    `collector`: the running forward's (router.model_collector)."""
    inside = sorted(key for key in (collector or {}) if key not in HANDLED_OUTPUTS)
    if inside:
        raise ValueError(
            f"{STREAMING_FIELD}: output_{inside[0]}=True is not supported in training with streaming backward "
            f"({type(layer).__name__} runs query chunk by query chunk, without graph in its forward: no whole "
            f"{inside[0]} tensor with gradients exists). Request them in eval mode, or unset the field."
        )

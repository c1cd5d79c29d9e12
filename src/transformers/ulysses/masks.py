"""Exact attention masks under DeepSpeed-Ulysses sequence parallelism.

DeepSpeed's `UlyssesSPAttentionHF.register_with_transformers` (what accelerate's
`ParallelismConfig(sp_backend="deepspeed")` calls) puts a wrapper in place of the model's core
attention function: an all-to-all turns each rank's [local sequence, all heads] into [whole
sequence, H/sp heads], the core attention runs, and a second all-to-all turns it back. The mask
the model built is for the local shard, so DeepSpeed drops it and the core sees `None`: plain
causal attention. Sliding windows, 2D padding and packed sequences (position_ids restarting)
are then silently ignored.

Here, when DeepSpeed registers its wrapper (`AttentionInterface.__setitem__`, patched), we
1. register for the same attention implementation a mask function that, instead of building a
   mask for the local shard, returns a `UlyssesMask`: the local 2D padding mask (or None, which
   decides packed-sequence detection exactly as upstream);
2. replace DeepSpeed's outer wrapper by one that keeps that object (DeepSpeed's own module does
   the all-to-alls and already all-gathers position_ids);
3. wrap DeepSpeed's core function: after the all-to-all it rebuilds the mask of the whole
   sequence with the model's own mask function (`create_causal_mask` or
   `create_sliding_window_causal_mask`, chosen as the attention module does through its
   `sliding_window`; Llama-4's chunked layers: `create_chunked_causal_mask`, chosen by the layer's
   `layer_types` entry), from the gathered position_ids and the gathered padding mask. The mask is
   built once per forward and mask kind, and, for sdpa, stays `None` (is_causal) when the whole
   sequence is plain causal, as upstream.
Anything we cannot rebuild raises a ValueError naming the setting, before an optimizer step.

A streamed layer (`streaming_backward_chunk`) gets the same `UlyssesMask`, a `ShardedSequenceMask`
(mst_core/sharded_sequence.py): it gathers its keys and values through it once per pass and runs
each query chunk through `streamed.py`.
"""

from __future__ import annotations

import torch

from ..mst_core.families import model_types
from ..mst_core.fields import STREAMING_FIELD
from ..mst_core.sharded_sequence import ShardedSequenceMask
from .exchange import (
    fits_deepspeed, gather_sequence, heads_to_sequence, scatter_sequence_grad, sequence_to_heads,
    whole_sequence_attention,
)
from .streamed import STREAMABLE_ATTENTION, StreamedQueryChunk

# Model types whose masks are exactly create_causal_mask / create_sliding_window_causal_mask /
# create_chunked_causal_mask of (config, padding mask, position_ids), chosen by the attention module's `sliding_window`
# or its layer's `layer_types` entry (families.py).
SUPPORTED_MODEL_TYPES = model_types(ulysses=True)

_rebuilding = False  # True while we call the model's mask function ourselves


class UlyssesMask(ShardedSequenceMask):
    """Stands in for the 4D mask of one forward: what is needed to rebuild it for the whole sequence."""

    def __init__(self, padding, q_length, uattn):
        self.padding = padding  # the local [batch, local_len] bool padding mask, or None (no 2D mask given)
        self.q_length = q_length  # local sequence length
        self.uattn = uattn  # DeepSpeed's UlyssesSPAttentionHF: the process group, the core attention
        self.world_size = uattn.world_size
        self.first_token = uattn.sp_rank * q_length  # ranks hold contiguous shards
        self._full_padding = None
        self.latents_gathered = False  # whether the last `gather_keys_values` gathered latents
        self._positions = None  # the whole sequence's position_ids, gathered once (streamed layers)
        self._built = {}

    # Code that only inspects a mask's shape or device (no family with `ulysses=True` does) fails loudly.
    def __repr__(self):
        return f"UlyssesMask(local_len={self.q_length}, padding={'yes' if self.padding is not None else 'no'})"

    def build(self, module, query, kwargs, uattn):
        global _rebuilding
        from ..masking_utils import create_causal_mask, create_chunked_causal_mask, create_sliding_window_causal_mask

        config = module.config
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"Ulysses sequence parallelism (sp_size={uattn.world_size}): transformers-mst rebuilds the attention "
                f"mask of the whole sequence only for model_type in {SUPPORTED_MODEL_TYPES}; got {model_type!r}, "
                "whose mask it cannot reproduce exactly. Train it without sequence parallelism."
            )
        if getattr(config, "output_router_logits", False) and getattr(config, "router_aux_loss_coef", 0):
            # Each rank's head would compute the router's auxiliary (load-balancing) loss from its own shard's
            # tokens; that loss is not linear in the tokens, so the ranks' shares do not add up to the whole
            # sequence's.
            raise ValueError(
                f"Ulysses sequence parallelism (sp_size={uattn.world_size}) with output_router_logits=True and "
                f"router_aux_loss_coef={config.router_aux_loss_coef}: each rank would add the router's auxiliary "
                "loss of its own shard of tokens, which is not the whole sequence's (the loss and its gradients "
                "would differ from one process). Set output_router_logits=False (the router logits are then not "
                "returned and no auxiliary loss is added) or router_aux_loss_coef=0, or train without sequence "
                "parallelism."
            )
        q_len = query.shape[-2]
        gathered = q_len != self.q_length
        if gathered and q_len != self.q_length * uattn.world_size:
            raise ValueError(
                f"Ulysses: query length {q_len} after the all-to-all is neither the local length {self.q_length} "
                f"nor {uattn.world_size} x it (sp_size={uattn.world_size})"
            )
        window = kwargs.get("sliding_window")
        if window is not None and window != getattr(config, "sliding_window", None):
            raise ValueError(f"Ulysses: attention sliding_window={window} differs from config.sliding_window")
        # Llama-4's rotary layers attend within chunks of attention_chunk_size (create_chunked_causal_mask)
        layer_types = getattr(config, "layer_types", None) or ()
        chunked = getattr(module, "layer_idx", None) is not None and module.layer_idx < len(layer_types) and (
            layer_types[module.layer_idx] == "chunked_attention"
        )
        key = (gathered, window is not None, chunked)
        if key not in self._built:
            padding = self.padding
            if gathered and padding is not None:
                padding = self._gather_padding(uattn)
            position_ids = kwargs.get("position_ids")
            if chunked:
                mask_function = create_chunked_causal_mask
            else:
                mask_function = create_sliding_window_causal_mask if window is not None else create_causal_mask
            # Only the shape, dtype and device of inputs_embeds are read.
            shape_only = query.new_empty((query.shape[0], q_len, 0))
            _rebuilding = True
            try:
                self._built[key] = mask_function(
                    config=config,
                    inputs_embeds=shape_only,
                    attention_mask=padding,
                    cache=None,
                    position_ids=position_ids,
                )
            finally:
                _rebuilding = False
        return self._built[key]

    def check_streamable(self, module):
        """Raise unless a streamed layer can run its query chunks through `module`'s attention here."""
        uattn = self.uattn
        implementation = uattn.core_attn_implementation
        if implementation not in STREAMABLE_ATTENTION:
            raise ValueError(
                f"{STREAMING_FIELD} under Ulysses sequence parallelism (sp_size={uattn.world_size}) runs query chunks "
                f"with attn_implementation in {STREAMABLE_ATTENTION}; got {implementation!r}. Use 'sdpa' (on a GPU it "
                "runs the chunks' causal blocks with FlashAttention kernels), or unset the field."
            )
        heads = module.config.num_attention_heads
        kv_heads = heads // getattr(module, "num_key_value_groups", 1)  # this layer's (Gemma-4: its own per layer)
        if heads % uattn.world_size or kv_heads % uattn.world_size:
            raise ValueError(
                f"{STREAMING_FIELD} under Ulysses sequence parallelism (sp_size={uattn.world_size}) splits the query "
                f"and key/value heads over the ranks: {heads} query heads and {kv_heads} key/value heads must both be "
                f"divisible by {uattn.world_size} (DeepSpeed's replication of too few key/value heads is not done on "
                "this path). Use an sp_size dividing both, or unset the field."
            )
        if not getattr(module, "is_causal", True):
            raise ValueError(
                f"{STREAMING_FIELD} needs causal attention; {type(module).__name__} is bidirectional here. Unset the field."
            )

    def gather_keys_values(self, keys, values):
        group = self.uattn.process_group
        self.latents_gathered = keys.shape[1] == values.shape[1] == 1  # for scatter_grad, which follows
        if self.latents_gathered:
            # Multi-head Latent Attention (DeepSeek-V2/V3, GLM-4.7-Flash) caches one latent "head" that every query
            # head reads after upstream expands it (`kv_b_proj`), so there are no heads to split: every rank takes
            # the whole sequence's latents (check_streamable lets no other single-head K/V through when sp > 1),
            # and each chunk attends its own rows with all heads (streamed.py).
            return gather_sequence(keys, group), gather_sequence(values, group)
        return heads_to_sequence(keys, self.world_size, group), heads_to_sequence(values, self.world_size, group)

    def scatter_grad(self, grad):
        if self.latents_gathered:  # this layer's latents (above)
            return scatter_sequence_grad(grad, self.uattn.process_group)
        return sequence_to_heads(grad, self.world_size, self.uattn.process_group)

    def query_chunk(self, start, end, position_ids, causal_bias):
        if position_ids is None:
            raise ValueError(
                f"{STREAMING_FIELD} under Ulysses sequence parallelism: the decoder layer got no position_ids, from "
                "which the whole sequence's mask is rebuilt. Pass position_ids (UlyssesSPDataLoaderAdapter and "
                "accelerate's sequence-parallel data loading do)."
            )
        return StreamedQueryChunk(self, start, end, position_ids, causal_bias)

    def gathered_positions(self, position_ids, uattn):
        """The whole sequence's [B, S] position_ids from each rank's [B, S/sp] (one all-gather per forward)."""
        if self._positions is None:
            position_ids = position_ids.contiguous()
            parts = [torch.empty_like(position_ids) for _ in range(uattn.world_size)]
            torch.distributed.all_gather(parts, position_ids, group=uattn.process_group)
            self._positions = torch.cat(parts, dim=1)
        return self._positions

    def _gather_padding(self, uattn):
        if self._full_padding is None:
            local = self.padding.to(torch.int64).contiguous()  # gloo has no bool all_gather
            parts = [torch.empty_like(local) for _ in range(uattn.world_size)]
            torch.distributed.all_gather(parts, local, group=uattn.process_group)
            self._full_padding = torch.cat(parts, dim=1).to(torch.bool)
        return self._full_padding


def tokens_before_shard(attention_mask) -> int:
    """The tokens of the sequence before this rank's shard where `attention_mask` is a `UlyssesMask` (0 otherwise):
    where a layer numbers its queries itself (Llama-4's NoPE layers, arXiv 2501.19399's temperature tuning, patch
    0006), the positions of the whole sequence, as one process numbers them."""
    return attention_mask.first_token if isinstance(attention_mask, UlyssesMask) else 0


def position_ids_for_ulysses(attention_mask, position_ids) -> dict:
    """{"position_ids": position_ids} for the attention call where `attention_mask` is a `UlyssesMask`, else {}: a
    decoder layer that does not pass its position_ids on to its attention (Llama-4's, patch 0006) gives them to the
    Ulysses attention, which gathers them for the whole sequence's mask; without Ulysses the call is upstream's."""
    return {"position_ids": position_ids} if isinstance(attention_mask, UlyssesMask) else {}


def _ulysses_mask_function(original, uattn):
    """The mask function registered under Ulysses: returns a UlyssesMask instead of a local 4D mask."""

    def mask_function(*args, **kwargs):
        if _rebuilding:
            return original(*args, **kwargs)
        q_length, kv_length = kwargs["q_length"], kwargs["kv_length"]
        if kwargs.get("q_offset", 0) != 0 or kwargs.get("kv_offset", 0) != 0 or kv_length != q_length:
            raise ValueError(
                "Ulysses sequence parallelism: a key/value cache is not supported while "
                "training with sp_size > 1"
            )
        return UlyssesMask(kwargs.get("attention_mask"), q_length, uattn)

    mask_function._mst_original = original
    return mask_function


def _core_attention(original, uattn):
    """Runs after DeepSpeed's all-to-all: the whole sequence, H/sp heads, gathered position_ids."""

    def core(module, query, key, value, attention_mask, *args, **kwargs):
        if isinstance(attention_mask, UlyssesMask):
            attention_mask = attention_mask.build(module, query, kwargs, uattn)
        elif attention_mask is not None:
            raise ValueError(
                f"Ulysses sequence parallelism (sp_size={uattn.world_size}) got a ready-made attention mask of "
                f"type {type(attention_mask).__name__}; it was built for one rank's shard and cannot be rebuilt "
                "for the whole sequence. Pass a 2D attention_mask (padding) and position_ids instead."
            )
        else:
            raise ValueError(
                f"Ulysses sequence parallelism (sp_size={uattn.world_size}): the model passed no attention mask, "
                f"so transformers-mst cannot rebuild it for the whole sequence (attn_implementation="
                f"{uattn.core_attn_implementation!r}). Use attn_implementation 'sdpa', 'flash_attention_2', "
                "'flash_attention_3' or 'flex_attention'."
            )
        return original(module, query, key, value, attention_mask, *args, **kwargs)

    core._mst_original = original
    return core


def _closure_vars(function):
    names = function.__code__.co_freevars
    return {name: cell.cell_contents for name, cell in zip(names, function.__closure__ or ())}


def is_deepspeed_ulysses_wrapper(value) -> bool:
    return getattr(value, "__qualname__", "").startswith("UlyssesSPAttentionHF.register_with_transformers")


def wrap_registered_attention(key, value):
    """Called by AttentionInterface.__setitem__: returns what to register under `key` instead of `value`.

    Anything but DeepSpeed's Ulysses wrapper passes unchanged (upstream behaviour).
    """
    if not is_deepspeed_ulysses_wrapper(value):
        return value
    from ..masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    uattn = _closure_vars(value).get("uattn")
    if uattn is None or not hasattr(uattn, "attn") or not hasattr(uattn, "process_group"):
        raise ValueError(
            "transformers-mst cannot find the UlyssesSPAttentionHF module inside DeepSpeed's attention wrapper "
            "(DeepSpeed version not supported: tested with deepspeed 0.19.8); without it the attention masks "
            "(sliding window, padding, packed sequences) would be silently dropped under sequence parallelism"
        )
    if key not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        raise ValueError(
            f"Ulysses sequence parallelism with attn_implementation={key!r}: transformers has no mask function for "
            "it, so transformers-mst cannot rebuild the attention mask of the whole sequence. Use 'sdpa', "
            "'flash_attention_2', 'flash_attention_3' or 'flex_attention'."
        )
    # A second registration in the same process wraps what the first left behind: start again from the
    # original core attention function.
    core = uattn.attn
    while hasattr(core, "_mst_original"):
        core = core._mst_original
    uattn.attn = _core_attention(core, uattn)
    mask_function = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[key]
    while hasattr(mask_function, "_mst_original"):
        mask_function = mask_function._mst_original
    ALL_MASK_ATTENTION_FUNCTIONS[key] = _ulysses_mask_function(mask_function, uattn)

    def ulysses_attention(module, query, key_states, value_states, attention_mask, *args, **kwargs):
        if isinstance(attention_mask, StreamedQueryChunk):  # a streamed layer's query chunk (streamed.py)
            return attention_mask.attend(module, query, key_states, value_states, core, uattn, args, kwargs)
        if isinstance(attention_mask, UlyssesMask) and not fits_deepspeed(uattn, query, key_states, value_states):
            # A layer whose head size or key/value heads are not the ones DeepSpeed's module was built for.
            positions = attention_mask.gathered_positions(kwargs["position_ids"], uattn)
            return whole_sequence_attention(
                module, query, key_states, value_states, attention_mask, positions, uattn.attn, uattn, args, kwargs
            )
        # DeepSpeed's wrapper would drop attention_mask here; our core function rebuilds it.
        return uattn(module, query, key_states, value_states, attention_mask, *args, **kwargs)

    ulysses_attention._mst_original = core
    return ulysses_attention

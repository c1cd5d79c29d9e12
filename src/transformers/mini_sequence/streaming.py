"""StreamBP (arXiv 2506.03077, §3.2.2, Fig. 2, App. C): exact streaming backward through a whole decoder layer.

The hand-written Llama-like / Gemma-2 layouts below remain the path of llama, mistral, qwen2 and gemma2 until
their CPU key slabs, FlashAttention chunks, row blocks and planner hooks are ported to the generic streamed layer
(transformers/streaming_backward/layer.py: the layer's own forward per chunk), which every other streamed family
takes (`decoder_layer_forward` dispatches) and which is exact on these four too (`EVERY_LAYER`).

With `config.streaming_backward_chunk` set, a Llama / Mistral / Qwen2 / Gemma-2 decoder layer in
training keeps only its input for backward (as activation checkpointing does), and its backward
runs one query chunk at a time:

1. K and V of the whole sequence are computed once (after RoPE, before `repeat_kv`), without graph;
2. for each query chunk `[start, end)`: norm -> q -> attention against the causal prefix
   `K/V[kv_start:end]` -> o_proj -> residual -> norm -> MLP is recomputed with grad and that chunk's
   output gradient is backpropagated; parameter gradients, dK, dV and the input gradient add up;
3. dK, dV are backpropagated through the K/V projections, RoPE and the input norm, chunk by chunk.

Alive at once: the input, K, V, dK, dV and one chunk's working set (no [B, heads, S, S] scores, no
full-sequence Q or attention output). On CPU a chunk's attention runs key slab by key slab through torch's
flash-attention kernels, which return each row's logsumexp: its backward adds each slab's dK/dV into the
accumulators, where SDPA's backward would return dK/dV for the whole key prefix (two more K/V-sized tensors
at the last chunk); plainly causal chunks need no mask tensor either (`_SlabbedAttention`). Other devices
take SDPA or the model's attention function per chunk (the same kernels exist on CUDA, untested here).
The forward runs the same chunks without graph, so forward and backward see the same arithmetic. Gradients
equal the unsplit layer's to fp32 rounding: attention of a query row only reads the keys its mask allows,
and the chunk's mask is the exact slice of the full mask (or, when the model passed none because the
attention is plainly causal, torch's lower-right causal bias for SDPA, or the causal/sliding mask built by
`masking_utils.sdpa_mask` with the chunk's offsets: SDPA's own `is_causal` aligns the mask top-left and
would be wrong for every chunk after the first). FlashAttention (>= 2.1) aligns its causal mask and window
bottom-right itself: a chunk passes it the padding mask's key columns, or per-chunk cu_seq_lens for packed
sequences (`_plan_flash_chunks`).

The backward runs the chunks from the last to the first, each replaying its own forward RNG state: a row
block's dK/dV are final once its first chunk is done, so they are backpropagated through the K/V
projections and freed while the input gradient grows (streaming_backward/rows.py, `_backward_schedule`).

When gradient checkpointing is on too, streaming replaces it for these layers (one recompute, not
two): `modeling_layers.GradientCheckpointingLayer` asks `applies(layer)` first. Eval, generation and
frozen layers run upstream's forward. If checkpointing was enabled with `offload=True`, the streamed
layer keeps its input in (pinned) host memory instead, and its backward brings it back one chunk at a
time (`HostStorage`): the accelerator never holds a layer's whole input again, only K, V, their
gradients, the input gradient and one chunk.

Wrappers: the Function takes the layer's parameters as inputs when they are plain, hook-free leaf
parameters while the layer runs (one process, DDP, PEFT LoRA, and FSDP2 with decoder layers as units:
its pre-forward hook has already swapped in unsharded plain parameters). When a wrapper may swap the
weights inside the layer (ZeRO-3's per-module gathers, FSDP1's flat-parameter views; see wrappers.py)
the same chunks run under nested non-reentrant checkpointing instead: the layer is checkpointed as a
whole, and each query chunk inside it, so autograd delivers every gradient the wrapper expects. That
costs more forward work: each chunk runs 3n - 1 times for n chunks (forward, the layer's recompute,
which torch stops early before the last chunk, and the chunk's own recompute) against 2n.
"""

import bisect
import contextlib
import inspect
import sys

import torch
from torch.nn.attention.bias import causal_lower_right
from torch.utils._python_dispatch import _disable_current_modes

from ._state import (
    accumulate_grads,
    capture_autocast_state,
    capture_rng_state,
    restore_autocast_state,
    restore_rng_state,
)
from .config import STREAMING_FIELD_NAME, streaming_chunk_size
from .wrappers import check_graph_inputs, function_parameters, refuse_create_graph
from ..streaming_backward import layer as generic
from ..streaming_backward import rows
from ..streaming_backward.masks import chunk_mask, plan_key_ranges, sliding_window, window_start


# Decoder layers we know how to stream, by the module that defines them -> layer layout.
_LLAMA_LIKE = "pre-norm"  # x + attn(norm(x)), then h + mlp(norm(h))
_GEMMA2 = "sandwich-norm"  # x + norm(attn(norm(x))), then h + norm(mlp(norm(h)))
SUPPORTED_LAYERS = {
    ("transformers.models.llama.modeling_llama", "LlamaDecoderLayer"): _LLAMA_LIKE,
    ("transformers.models.mistral.modeling_mistral", "MistralDecoderLayer"): _LLAMA_LIKE,
    ("transformers.models.qwen2.modeling_qwen2", "Qwen2DecoderLayer"): _LLAMA_LIKE,
    ("transformers.models.gemma2.modeling_gemma2", "Gemma2DecoderLayer"): _GEMMA2,
}
FLASH_ATTENTION = "flash_attention_2"
SUPPORTED_ATTENTION = ("sdpa", "eager", FLASH_ATTENTION)
# FlashAttention's own packing inputs: the streamed layer turns them into per-chunk ones (`_plan_flash_chunks`).
_FLASH_VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
# Attention functions that, called with mask=None, mask an offset query chunk causally themselves, aligned
# bottom-right (FlashAttention's convention), so a chunk needs no mask tensor. Only the planner registers one
# (plan.py: its FlashAttention-like memory stand-in, whose step must not allocate a [chunk, keys] mask).
BOTTOM_RIGHT_CAUSAL_ATTENTION = set()
# Keys per slab of a query chunk's attention on CPU (`_SlabbedAttention`): one slab's dK/dV is what its backward
# holds beyond the accumulators, so any size far below the sequence will do; large enough to keep calls few.
# Measured (fp32, d=256, S=8192, 2 threads, median of 3 steps): 1024 keys 6.77 s, 2048 6.64 s, 4096 7.43 s; at
# S=32K 1024 keeps 2 MiB less than 2048.
SLAB_KEYS = 1024
SLABBED_DEVICES = ("cpu",)  # where those kernels are wired (see _CPU_FLASH)

def _layout(layer):
    for cls in type(layer).__mro__:  # FSDP2 subclasses the layer class
        layout = SUPPORTED_LAYERS.get((cls.__module__, cls.__name__))
        if layout is not None:
            return cls, layout
    return None, None


def applies(layer) -> bool:
    """Whether `layer`'s forward should stream (called by GradientCheckpointingLayer for every layer)."""
    config = getattr(getattr(layer, "self_attn", None), "config", None)
    if getattr(config, STREAMING_FIELD_NAME, None) is None or not (layer.training and torch.is_grad_enabled()):
        return False
    # A layer of another family (the field set on a model type without the path, from `from_pretrained` or a
    # config.json) is not streamed: the model warned at construction that the field is ignored (support.py).
    return _layout(layer)[1] is not None or generic.streams(layer)


def _lower_right_causal_bias(q_len: int, kv_len: int):
    """torch's lower-right causal bias (a Tensor subclass holding only the sizes), created with any active
    TorchDispatchMode (a memory tracker, FakeTensorMode) suspended: torch cannot create that subclass under
    one. The attention call itself runs under the modes as usual."""
    with _disable_current_modes():
        return causal_lower_right(q_len, kv_len)


def _rope(states, cos, sin, rotate_half):
    # The family's apply_rotary_pos_emb, for one tensor (q or k) at a time.
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return states * cos + rotate_half(states) * sin


class HostStorage:
    """Where an offloaded streamed layer keeps its input: a host copy (pinned when the input is on an
    accelerator, as upstream's `save_on_cpu(pin_memory=True)` does), read back by row ranges. The copies
    run on the current stream, like upstream's offload. The planner swaps in a stand-in (`use_host_storage`)
    that holds no bytes and counts them as host memory."""

    def save(self, x: torch.Tensor):
        pinnable = x.device.type != "cpu" and torch.get_device_module(x.device).is_available()
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=pinnable)
        host.copy_(x, non_blocking=pinnable)
        return host

    def load(self, saved, start: int, end: int, device: torch.device) -> torch.Tensor:
        """Rows [start, end) of the saved input, on `device`."""
        return saved[:, start:end].to(device, non_blocking=saved.is_pinned())


HOST_STORAGE = [HostStorage()]  # the one in use: the last


@contextlib.contextmanager
def use_host_storage(storage):
    """Offloaded streamed layers use `storage` (an object with `save` and `load`) inside."""
    HOST_STORAGE.append(storage)
    try:
        yield storage
    finally:
        HOST_STORAGE.remove(storage)


class _SavedInput:
    """A streamed layer's input as its backward reads it: rows [start, end) at a time, from the accelerator
    (kept there, as checkpointing keeps it) or from host memory (offload)."""

    def __init__(self, x: torch.Tensor, offload: bool):
        self.shape, self.dtype, self.device = x.shape, x.dtype, x.device
        self.storage = HOST_STORAGE[-1] if offload else None
        self.saved = self.storage.save(x) if offload else x

    def rows(self, start: int, end: int) -> torch.Tensor:
        if self.storage is None:
            return self.saved[:, start:end]
        return self.storage.load(self.saved, start, end, self.device)


class _StreamedLayer:
    """One call of a decoder layer, split into query chunks: the pieces both paths share."""

    def __init__(self, layer, layout, family_module, hidden_states, attention_mask, position_embeddings, kwargs):
        attn = layer.self_attn
        config = attn.config
        self.layer, self.attn, self.layout = layer, attn, layout
        self.rotate_half = family_module.rotate_half
        implementation = config._attn_implementation
        if implementation not in SUPPORTED_ATTENTION and implementation not in BOTTOM_RIGHT_CAUSAL_ATTENTION:
            raise ValueError(
                f"{STREAMING_FIELD_NAME} is set but the model uses attn_implementation={implementation!r}; streaming "
                f"backward runs offset query chunks only with {SUPPORTED_ATTENTION}. Load the model with one of "
                "them, or unset the field."
            )
        self.flash = implementation == FLASH_ATTENTION
        if self.flash:
            from ..modeling_flash_attention_utils import flash_attn_supports_top_left_mask

            if flash_attn_supports_top_left_mask():
                raise ValueError(
                    f"{STREAMING_FIELD_NAME}: the installed flash-attn aligns its causal mask top-left (before 2.1), "
                    "which masks every query chunk after the first wrongly. Install flash-attn >= 2.1, or use "
                    "attn_implementation='sdpa'."
                )
        from ..modeling_utils import ALL_ATTENTION_FUNCTIONS

        self.attention = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, family_module.eager_attention_forward)
        if not getattr(attn, "is_causal", True):
            raise ValueError(
                f"{STREAMING_FIELD_NAME} needs causal attention (each query chunk reads only earlier keys); "
                f"{type(attn).__name__} is bidirectional here (use_bidirectional_attention). Unset the field."
            )
        if position_embeddings is None:
            raise ValueError(f"{STREAMING_FIELD_NAME}: the decoder layer was called without position_embeddings.")
        batch, seq_len = hidden_states.shape[:2]
        if attention_mask is not None and self.flash:
            # FlashAttention gets the [batch, key] padding mask (or none) and unpads by it, as upstream does.
            if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != (batch, seq_len):
                raise ValueError(
                    f"{STREAMING_FIELD_NAME}: with flash_attention_2 the decoder layer got an attention mask of shape "
                    f"{getattr(attention_mask, 'shape', None)}; streaming slices a [batch, {seq_len}] padding mask "
                    "per chunk and supports no other kind (a KV cache or prefix is not supported)."
                )
        elif attention_mask is not None:
            if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 4:
                raise ValueError(
                    f"{STREAMING_FIELD_NAME}: the decoder layer got an attention mask of type "
                    f"{type(attention_mask).__name__} (shape {getattr(attention_mask, 'shape', None)}); streaming "
                    "slices a 4D [batch, 1, query, key] mask per chunk and supports no other kind."
                )
            if tuple(attention_mask.shape[-2:]) != (seq_len, seq_len):
                raise ValueError(
                    f"{STREAMING_FIELD_NAME}: the 4D attention mask covers {tuple(attention_mask.shape[-2:])} "
                    f"(query, key) positions for a sequence of {seq_len}; a KV cache or prefix is not supported."
                )
        self.mask = attention_mask
        self.cos, self.sin = position_embeddings
        self.window = sliding_window(attn)
        self.batch, self.seq_len = batch, seq_len
        chunk = streaming_chunk_size(getattr(config, STREAMING_FIELD_NAME), config.hidden_size)
        self.chunks = [(start, min(start + chunk, seq_len)) for start in range(0, seq_len, chunk)]
        # Consecutive chunks grouped into row blocks (streaming_backward/rows.py): (first chunk, end chunk).
        self.blocks = rows.row_blocks(self.chunks)
        # RNG state before each chunk's K/V and before its output in the forward (`record_rng`), so that the
        # backward can replay any chunk's dropout draws in its own order.
        self.kv_rng = self.chunk_rng = None
        # What upstream's attention module passes to the attention function besides q, k, v and the mask.
        self.attention_kwargs = dict(kwargs)
        self.attention_kwargs.update(
            dropout=attn.attention_dropout if attn.training else 0.0, scaling=attn.scaling, is_causal=False
        )
        if self.window is not None:
            self.attention_kwargs["sliding_window"] = self.window
        if getattr(attn, "attn_logit_softcapping", None) is not None:
            self.attention_kwargs["softcap"] = attn.attn_logit_softcapping
        if self.flash:
            # Causal, aligned bottom-right by FlashAttention itself: right for an offset chunk. Packing (position_ids
            # or FlashAttention's own cu_seq_lens) is given per chunk instead (`_plan_flash_chunks`).
            self.attention_kwargs["is_causal"] = True
            self.sequence_starts = self._packed_sequence_starts(batch)
            for name in ("position_ids", *_FLASH_VARLEN_KWARGS):
                self.attention_kwargs.pop(name, None)
        self.plain_causal_sdpa = (
            implementation == "sdpa"
            and attention_mask is None
            and (self.window is None or self.window >= seq_len)  # a window longer than the sequence cuts nothing
            and "softcap" not in self.attention_kwargs
        )
        self.scale = attn.scaling
        # On CPU, chunks run as `_SlabbedAttention` when its kernels compute what the model's function would: no
        # soft-capping, no dropout (its draws could not be replayed slab by slab), a mask or plain causality.
        self.slabbed = (
            hidden_states.device.type in SLABBED_DEVICES
            and implementation in ("sdpa", "eager")
            and self.attention_kwargs["dropout"] == 0.0
            and "softcap" not in self.attention_kwargs
            and (attention_mask is not None or self.plain_causal_sdpa)
        )

    def _window_start(self, start: int) -> int:
        """First key a query chunk starting at `start` can see: 0, or the sliding window's first key."""
        return window_start(self.window, start)

    def _packed_sequence_starts(self, batch: int):
        """Where the packed sequences start, as upstream's FlashAttention path would split the batch: none with a
        padding mask (it unpads by the mask), else FlashAttention's own cu_seq_lens when given, else the
        restarts of position_ids (one row, as upstream requires). None when nothing is packed."""
        from ..modeling_flash_attention_utils import _is_packed_sequence, prepare_fa_kwargs_from_position_ids

        kwargs = self.attention_kwargs
        if self.mask is not None:
            return None
        if all(kwargs.get(name) is not None for name in _FLASH_VARLEN_KWARGS):
            cu_q, cu_k = kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"]
            if cu_q.shape != cu_k.shape or not bool((cu_q == cu_k).all()) or int(cu_q[-1]) != batch * self.seq_len:
                raise ValueError(
                    f"{STREAMING_FIELD_NAME}: cu_seq_lens_q and cu_seq_lens_k must both split the whole "
                    f"{batch} x {self.seq_len} tokens the same way (self-attention over packed sequences)."
                )
            if batch != 1:
                raise ValueError(f"{STREAMING_FIELD_NAME}: packed sequences (cu_seq_lens) need batch size 1, got {batch}.")
            return cu_q[:-1].tolist()
        position_ids = kwargs.get("position_ids")
        if _is_packed_sequence(position_ids, batch):
            (cu_q, _), _ = prepare_fa_kwargs_from_position_ids(position_ids)
            return cu_q[:-1].tolist()
        return None

    def _plan_flash_chunks(self) -> None:
        """Key ranges and FlashAttention arguments per chunk (`self.flash_kwargs`, `self.flash_rows`).

        FlashAttention masks a chunk itself (causal bottom-right, the window, per packed sequence), so the key
        range is the causal prefix from the window's first key, and from the first key of the packed sequence
        the chunk starts in: the chunk's sequences then have consecutive key parts for cu_seq_lens_k. With a
        padding mask the window counts unpadded tokens (upstream unpads first), so a windowed chunk reads from
        key 0 there. Batch rows with no real query in a chunk (left padding) are left out of its call and get
        zeros, as upstream's padding rows do: varlen kernels have had bugs with empty query segments."""
        self.key_ranges, self.blind_chunks, self.flash_kwargs, self.flash_rows = [], set(), [], []
        starts = self.sequence_starts
        device = self.cos.device
        for start, end in self.chunks:
            kv_start = 0 if self.mask is not None else self._window_start(start)
            kwargs, rows = {}, None
            if starts is not None:
                kv_start = max(kv_start, starts[bisect.bisect_right(starts, start) - 1])
                inner = starts[bisect.bisect_right(starts, start) : bisect.bisect_left(starts, end)]
                q_edges, k_edges = [start, *inner, end], [kv_start, *inner, end]
                lengths = [b - a for a, b in zip(q_edges, q_edges[1:])]
                key_lengths = [b - a for a, b in zip(k_edges, k_edges[1:])]
                kwargs = {
                    "cu_seq_lens_q": torch.tensor([e - start for e in q_edges], dtype=torch.int32, device=device),
                    "cu_seq_lens_k": torch.tensor([e - kv_start for e in k_edges], dtype=torch.int32, device=device),
                    "max_length_q": max(lengths),
                    "max_length_k": max(key_lengths),
                }
            if self.mask is not None:
                has_query = self.mask[:, start:end].bool().any(dim=-1)
                if not bool(has_query.all()):
                    rows = has_query.nonzero().view(-1)
            self.key_ranges.append((kv_start, end))
            self.flash_kwargs.append(kwargs)
            self.flash_rows.append(rows)

    def flash_chunk_attention(self, queries, keys, values, index: int):
        """FlashAttention of chunk `index` through the model's function (see `_plan_flash_chunks`)."""
        kv_start, kv_end = self.key_ranges[index]
        mask = None if self.mask is None else self.mask[:, kv_start:kv_end]
        kwargs = {**self.attention_kwargs, **self.flash_kwargs[index]}
        rows = self.flash_rows[index]
        if rows is None:
            return self.attention(self.attn, queries, keys, values, mask, **kwargs)[0]
        batch, heads, length, head_dim = queries.shape
        out = queries.new_zeros(batch, length, heads, head_dim)
        if rows.numel():
            part = self.attention(self.attn, queries[rows], keys[rows], values[rows], mask[rows], **kwargs)[0]
            out = out.index_put((rows,), part)
        return out

    def plan_key_ranges(self) -> None:
        """For each query chunk, the key range [kv_start, kv_end) its attention reads (`self.key_ranges`).

        Normally the causal prefix (from the window's first key under a sliding window). Raises if the
        model's mask lets a query see a key outside it (a prefix-LM or custom mask): slicing would drop
        those keys. A chunk holding a query that may see no key at all (a left-padding position) reads the
        whole sequence with its full mask rows, as upstream does: eager softmax over an all-masked row is
        uniform over every key, and with left padding the last padding position predicts the first real
        label, so that value reaches the loss. Reads the mask once, in the forward.
        """
        if self.flash:
            self._plan_flash_chunks()
            return
        if self.mask is None and self.attn.config._attn_implementation == "eager":
            # Upstream's eager attention with no mask attends to every key, future ones included.
            raise ValueError(f"{STREAMING_FIELD_NAME}: eager attention was called without a mask (bidirectional).")
        self.key_ranges, self.blind_chunks = plan_key_ranges(self.mask, self.chunks, self.window, self.seq_len)

    def slabs(self, index: int):
        """Chunk `index`'s key range in slabs for `_SlabbedAttention`: (first, end, causal) relative to the range's
        first key. With no mask (plainly causal) the chunk's own keys are one causal square, where the kernel's
        top-left causal alignment is the right one, and the keys before it need no mask; with a mask, each slab
        gets its part of the mask (`slab_mask`)."""
        start, end = self.chunks[index]
        kv_start, kv_end = self.key_ranges[index]
        unmasked_end = start - kv_start if self.mask is None else kv_end - kv_start
        slabs = [(first, min(first + SLAB_KEYS, unmasked_end), False) for first in range(0, unmasked_end, SLAB_KEYS)]
        if self.mask is None:
            slabs.append((unmasked_end, kv_end - kv_start, True))
        return slabs

    def slab_mask(self, index: int, first: int, end_key: int, dtype: torch.dtype):
        """The model's mask for chunk `index` and keys [first, end_key) of its range, additive in `dtype` as the
        CPU kernels take it (a query row may see no key of one slab: the merge by logsumexp gives it no weight)."""
        if self.mask is None:
            return None
        start, end = self.chunks[index]
        kv_start = self.key_ranges[index][0]
        part = self.mask[:, :, start:end, kv_start + first : kv_start + end_key]
        if part.dtype != torch.bool:
            return part.to(dtype)
        return torch.zeros(part.shape, dtype=dtype, device=part.device).masked_fill_(~part, torch.finfo(dtype).min)

    def chunk_mask(self, start: int, end: int, kv_start: int, kv_end: int) -> torch.Tensor | None:
        if self.mask is None and self.attn.config._attn_implementation in BOTTOM_RIGHT_CAUSAL_ATTENTION:
            return None
        return chunk_mask(self.mask, self.batch, start, end, kv_start, kv_end, self.window, self.cos.device)

    def keys_values(self, x_chunk, start: int, end: int):
        """K (after RoPE) and V of the tokens `x_chunk` = x[:, start:end], [B, kv_heads, T, head_dim]."""
        attn = self.attn
        normed = self.layer.input_layernorm(x_chunk)
        shape = (*x_chunk.shape[:-1], -1, attn.head_dim)
        keys = attn.k_proj(normed).view(shape).transpose(1, 2)
        values = attn.v_proj(normed).view(shape).transpose(1, 2)
        keys = _rope(keys, self.cos[:, start:end], self.sin[:, start:end], self.rotate_half)
        return keys, values

    def all_keys_values(self, rows, record_rng=False):
        """K and V of the whole sequence, computed chunk by chunk (the same arithmetic and dropout draws as
        the backward's per-chunk recomputation), written into two preallocated tensors. `rows(start, end)`
        gives the layer input's rows."""
        keys = values = None
        if record_rng:
            self.kv_rng = []
        for start, end in self.chunks:
            if record_rng:
                self.kv_rng.append(capture_rng_state(self.cos.device))
            k, v = self.keys_values(rows(start, end), start, end)
            if keys is None:
                keys = k.new_empty(k.shape[:2] + (self.seq_len,) + k.shape[3:])
                values = v.new_empty(v.shape[:2] + (self.seq_len,) + v.shape[3:])
            keys[:, :, start:end].copy_(k)
            values[:, :, start:end].copy_(v)
        return keys, values

    def chunk_attention(self, queries, keys, values, index: int, sink=None):
        """Attention of query chunk `index` against its key range; [B, T, heads, head_dim] as HF's functions give.

        flash_attention_2 chunks go to `flash_chunk_attention`. On CPU, with no soft-capping or dropout, the
        forward (no graph) and the backward's recomputation (which passes `sink`) run `_SlabbedAttention`,
        except in a chunk holding a query that sees no key (left padding: upstream's function decides what such
        a row gets). Under checkpointing (the wrapper path, no `sink`) autograd must get dK/dV back, so the
        model's function runs. Otherwise, a plainly causal SDPA chunk (the model passed no mask: no padding or
        packing, no window shorter than the sequence) goes to torch's SDPA with a lower-right causal bias: on
        CUDA that runs FlashAttention's causal kernel for an offset chunk with no mask tensor and no K/V
        repeated to every query head (`enable_gqa`), where HF's function, given the chunk's mask, would build a
        [chunk, keys] mask and expand K/V. Everything else goes through the model's attention function."""
        start, end = self.chunks[index]
        if self.flash:
            return self.flash_chunk_attention(queries, keys, values, index)
        if self.slabbed and index not in self.blind_chunks and (sink is not None or not torch.is_grad_enabled()):
            return _SlabbedAttention.apply(queries, keys, values, self, index, sink).transpose(1, 2)
        if self.plain_causal_sdpa:
            out = torch.nn.functional.scaled_dot_product_attention(
                queries,
                keys,
                values,
                attn_mask=_lower_right_causal_bias(queries.shape[-2], keys.shape[-2]),
                dropout_p=self.attention_kwargs["dropout"],
                scale=self.attention_kwargs["scaling"],
                enable_gqa=queries.shape[1] != keys.shape[1],
            )
            return out.transpose(1, 2)
        mask = self.chunk_mask(start, end, *self.key_ranges[index])
        return self.attention(self.attn, queries, keys, values, mask, **self.attention_kwargs)[0]

    def chunk_output(self, x_chunk, keys, values, index: int, sink=None):
        """The layer's output rows of chunk `index`, given K/V rows `self.key_ranges[index]`. With `sink` (dK and
        dV accumulators of the whole sequence), attention may add its K/V gradients there itself (then its
        graph returns none for `keys` and `values`)."""
        start, end = self.chunks[index]
        layer, attn = self.layer, self.attn
        normed = layer.input_layernorm(x_chunk)
        shape = (*x_chunk.shape[:-1], -1, attn.head_dim)
        queries = attn.q_proj(normed).view(shape).transpose(1, 2)
        queries = _rope(queries, self.cos[:, start:end], self.sin[:, start:end], self.rotate_half)
        attn_out = self.chunk_attention(queries, keys, values, index, sink)
        attn_out = attn.o_proj(attn_out.reshape(*x_chunk.shape[:-1], -1).contiguous())
        if self.layout == _GEMMA2:
            hidden = x_chunk + layer.post_attention_layernorm(attn_out)
            return hidden + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(hidden)))
        hidden = x_chunk + attn_out
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def forward_without_graph(self, x, record_rng=False):
        keys, values = self.all_keys_values(lambda start, end: x[:, start:end], record_rng)
        out = None
        if record_rng:
            self.chunk_rng = []
        for index, (start, end) in enumerate(self.chunks):
            if record_rng:
                self.chunk_rng.append(capture_rng_state(x.device))
            kv_start, kv_end = self.key_ranges[index]
            chunk_out = self.chunk_output(x[:, start:end], keys[:, :, kv_start:kv_end], values[:, :, kv_start:kv_end], index)
            if out is None:
                out = chunk_out.new_empty(x.shape[:2] + chunk_out.shape[2:])
            out[:, start:end].copy_(chunk_out)
            del chunk_out
        return out


# torch's CPU flash-attention kernels return each query row's logsumexp and take it back in backward: the
# backward of a query chunk can then run key slab by key slab against the whole row's output and logsumexp
# (FlashAttention's backward needs nothing else), adding each slab's dK/dV straight into the layer's
# accumulators. SDPA's own backward returns dK/dV for the chunk's whole key prefix: two K/V-sized tensors at
# the last chunk. (CUDA has the same pair of kernels with other signatures; not wired: never run on a GPU here.)
_CPU_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_CPU_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class _SlabbedAttention(torch.autograd.Function):
    """Attention of query chunk `index` against its key range `keys`/`values` (rows `kv_start:kv_end`), slab by
    slab (`_StreamedLayer.slabs`: key ranges relative to `kv_start`, each with its mask made when it is used),
    merged by logsumexp. Backward returns dQ and adds dK/dV into `sink` (the layer's two accumulators) instead of
    returning them: keys and values are inputs only so that the graph reaches them."""

    @staticmethod
    def forward(ctx, queries, keys, values, streamed, index, sink):
        out = lse = None
        for key_start, key_end, causal in streamed.slabs(index):
            part, part_lse = _CPU_FLASH(
                queries, keys[:, :, key_start:key_end], values[:, :, key_start:key_end],
                is_causal=causal, attn_mask=streamed.slab_mask(index, key_start, key_end, queries.dtype),
                scale=streamed.scale,
            )
            if out is None:
                out, lse = part.float(), part_lse
                continue
            merged = torch.logaddexp(lse, part_lse)
            out = out * (lse - merged).exp_().unsqueeze(-1) + part.float() * (part_lse - merged).exp_().unsqueeze(-1)
            lse = merged
        out = out.to(queries.dtype)
        ctx.save_for_backward(queries, out, lse)
        ctx.keys, ctx.values, ctx.streamed, ctx.index, ctx.sink = keys, values, streamed, index, sink
        return out

    @staticmethod
    def backward(ctx, grad_out):
        queries, out, lse = ctx.saved_tensors
        keys, values, streamed, index = ctx.keys, ctx.values, ctx.streamed, ctx.index
        grad_keys, grad_values = ctx.sink
        offset = streamed.key_ranges[index][0]
        grad_out = grad_out.contiguous()
        grad_queries = None
        for key_start, key_end, causal in streamed.slabs(index):
            part_q, part_k, part_v = _CPU_FLASH_BACKWARD(
                grad_out, queries, keys[:, :, key_start:key_end], values[:, :, key_start:key_end], out, lse, 0.0,
                causal, attn_mask=streamed.slab_mask(index, key_start, key_end, queries.dtype), scale=streamed.scale,
            )
            grad_keys.add(part_k, offset + key_start, offset + key_end)
            grad_values.add(part_v, offset + key_start, offset + key_end)
            grad_queries = part_q.float() if grad_queries is None else grad_queries.add_(part_q)
            del part_q, part_k, part_v
        return grad_queries.to(queries.dtype), None, None, None, None, None


def _row_blocks(streamed, like, dim, dtype):
    return rows.RowBlocks(streamed.chunks, streamed.blocks, like, dim, dtype)


def _backward_schedule(streamed):
    """The backward's chunk order, each chunk with the row blocks whose dK/dV are final once it is done.

    Chunks that read every key (a left-padding row that sees none: `blind_chunks`) go first, then the others
    from the last to the first. In that order a block is final once its first chunk is done, since every later
    chunk came before it and earlier chunks read no key past their own end, unless that first chunk is blind:
    those blocks are final at the end (returned separately). So dK/dV rows are freed while the input gradient
    grows, instead of both being whole at once."""
    blind = sorted(streamed.blind_chunks)
    order = blind + [index for index in reversed(range(len(streamed.chunks))) if index not in streamed.blind_chunks]
    first_chunks = {first: block for block, (first, _) in enumerate(streamed.blocks)}
    schedule = [
        (index, [first_chunks[index]] if index in first_chunks and index not in streamed.blind_chunks else [])
        for index in order
    ]
    at_end = [block for block, (first, _) in enumerate(streamed.blocks) if first in streamed.blind_chunks]
    return schedule, at_end


class _StreamedLayerFunction(torch.autograd.Function):
    """Inputs: x [B, S, d], the `_StreamedLayer`, whether to keep x in host memory, the layer's parameters
    that require grad (see mlp.py for why they are inputs). Saves only x (on the accelerator, or on the host:
    then nothing at all stays on the accelerator); K/V, masks and chunks are rebuilt in backward."""

    @staticmethod
    def forward(ctx, x, streamed, offload, *params):
        ctx.autocast_state = capture_autocast_state(x.device.type)
        ctx.streamed, ctx.params = streamed, params
        if offload:
            ctx.saved_input = _SavedInput(x, offload=True)
        else:
            ctx.save_for_backward(x)  # (saved-tensor hooks, e.g. a user's save_on_cpu, see it)
            ctx.saved_input = None
        return streamed.forward_without_graph(x, record_rng=True)  # dropout draws replayed in backward

    @staticmethod
    def backward(ctx, grad_out):
        """K/V of the whole sequence (no graph), then the chunks in `_backward_schedule`'s order, each
        recomputed with graph and backpropagated; after a chunk, the K/V projections' backward of the row
        blocks it made final. Each chunk and each K/V recomputation replays its own forward RNG state."""
        refuse_create_graph("streaming backward", "streaming_backward_chunk")
        x = ctx.saved_input
        if x is None:
            x = _SavedInput(ctx.saved_tensors[0], offload=False)
        streamed, params = ctx.streamed, ctx.params
        needs_x = ctx.needs_input_grad[0]
        wanted = [p for p, need in zip(params, ctx.needs_input_grad[3:]) if need]
        acc = [None] * len(wanted)
        device = grad_out.device
        grad_x = _row_blocks(streamed, grad_out, dim=1, dtype=x.dtype) if needs_x else None
        checked_keys_values = []

        def keys_values_backward(block, grad_keys, grad_values):
            """Backpropagate block `block`'s final dK/dV through RoPE, the K/V projections and the input norm."""
            block_keys, block_values = grad_keys.pop(block), grad_values.pop(block)
            if block_keys is None:
                return  # no query read these keys: nothing flows back from them
            first, end_chunk = streamed.blocks[block]
            block_start = streamed.chunks[first][0]
            for index in range(first, end_chunk):
                start, end = streamed.chunks[index]
                with restore_rng_state(streamed.kv_rng[index], device), torch.enable_grad():
                    x_chunk = x.rows(start, end).detach().requires_grad_(needs_x)
                    k_chunk, v_chunk = streamed.keys_values(x_chunk, start, end)
                    if not checked_keys_values:
                        check_graph_inputs(k_chunk, [x_chunk, *params], "streaming backward (keys)")
                        check_graph_inputs(v_chunk, [x_chunk, *params], "streaming backward (values)")
                        checked_keys_values.append(True)
                    inputs = ([x_chunk] if needs_x else []) + wanted
                    grads = torch.autograd.grad(
                        (k_chunk, v_chunk),
                        inputs,
                        (
                            block_keys[:, :, start - block_start : end - block_start].to(k_chunk.dtype),
                            block_values[:, :, start - block_start : end - block_start].to(v_chunk.dtype),
                        ),
                        allow_unused=True,
                    )
                if needs_x:
                    grad_x.add(grads[0], start, end)
                    grads = grads[1:]
                accumulate_grads(acc, grads)

        with restore_autocast_state(ctx.autocast_state):
            # From the first chunk's recorded state the K/V pass draws what the forward's drew.
            with restore_rng_state(streamed.kv_rng[0], device), torch.no_grad():
                keys, values = streamed.all_keys_values(x.rows)
            # dK/dV are summed over chunks: in fp32 for half-precision K/V, rounded once at the end.
            sum_dtype = torch.float32 if keys.dtype in (torch.float16, torch.bfloat16) else keys.dtype
            grad_keys = _row_blocks(streamed, keys, dim=2, dtype=sum_dtype)
            grad_values = _row_blocks(streamed, values, dim=2, dtype=sum_dtype)
            schedule, final_at_end = _backward_schedule(streamed)
            for step, (index, final_blocks) in enumerate(schedule):
                start, end = streamed.chunks[index]
                kv_start, kv_end = streamed.key_ranges[index]
                with restore_rng_state(streamed.chunk_rng[index], device), torch.enable_grad():
                    x_chunk = x.rows(start, end).detach().requires_grad_(needs_x)
                    k_chunk = keys[:, :, kv_start:kv_end].detach().requires_grad_()
                    v_chunk = values[:, :, kv_start:kv_end].detach().requires_grad_()
                    out = streamed.chunk_output(x_chunk, k_chunk, v_chunk, index, (grad_keys, grad_values))
                    if step == 0:
                        check_graph_inputs(out, [x_chunk, k_chunk, v_chunk, *params], "streaming backward")
                    inputs = [k_chunk, v_chunk] + ([x_chunk] if needs_x else []) + wanted
                    grads = torch.autograd.grad(out, inputs, grad_out[:, start:end], allow_unused=True)
                    del out  # this chunk's graph goes before the next one is built
                if grads[0] is not None:  # else the attention added them itself (_SlabbedAttention)
                    grad_keys.add(grads[0], kv_start, kv_end)
                    grad_values.add(grads[1], kv_start, kv_end)
                if needs_x:
                    grad_x.add(grads[2], start, end)
                accumulate_grads(acc, grads[3 if needs_x else 2 :])
                del grads
                for block in final_blocks:
                    keys_values_backward(block, grad_keys, grad_values)
            del keys, values
            for block in final_at_end:
                keys_values_backward(block, grad_keys, grad_values)
            if grad_keys.parts or grad_values.parts:  # a sum added after its block was backpropagated: lost
                raise RuntimeError(
                    f"streaming backward: K/V gradients of row blocks {sorted(grad_keys.parts)} were never "
                    "backpropagated; refusing to return incomplete gradients. Please report this with your setup."
                )

        for total, param in zip(acc, wanted):
            if total is None:
                raise RuntimeError(
                    f"streaming backward: a parameter of shape {tuple(param.shape)} that requires grad got no gradient "
                    f"from {type(streamed.layer).__name__}'s recomputation; refusing to return a missing gradient."
                )
        if needs_x:
            parts = [grad_x.pop(block) for block in range(len(streamed.blocks))]
            grad_x = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        param_grads = iter(total.to(p.dtype) for total, p in zip(acc, wanted))
        all_grads = [next(param_grads) if need else None for need in ctx.needs_input_grad[3:]]
        return (grad_x, None, None, *all_grads)


def _forward_with_checkpoints(streamed, x):
    """The same chunks under nested non-reentrant checkpointing, for layers whose weights a wrapper swaps."""
    from torch.utils.checkpoint import checkpoint

    def layer_body(x):
        parts = [streamed.keys_values(x[:, start:end], start, end) for start, end in streamed.chunks]
        keys = torch.cat([k for k, _ in parts], dim=2)
        values = torch.cat([v for _, v in parts], dim=2)
        del parts
        outs = []
        for index, (start, end) in enumerate(streamed.chunks):
            kv_start, kv_end = streamed.key_ranges[index]
            outs.append(
                checkpoint(
                    streamed.chunk_output,
                    x[:, start:end],
                    keys[:, :, kv_start:kv_end],
                    values[:, :, kv_start:kv_end],
                    index,
                    use_reentrant=False,
                )
            )
        return torch.cat(outs, dim=1)

    return checkpoint(layer_body, x, use_reentrant=False)


def _layer_parameters(layer):
    """The layer's parameters that require grad if the Function may take them as inputs, else None.

    Checked per child module rather than on the layer: transformers installs output-capturing hooks on
    decoder layers and attention modules (output_hidden_states / output_attentions), which only read the
    outputs; the streamed path calls the children, never `self_attn` itself.
    """
    attn = layer.self_attn
    modules = [child for name, child in layer.named_children() if name != "self_attn"] + list(attn.children())
    params = []
    for module in modules:
        module_params = function_parameters(module)
        if module_params is None:
            return None
        params += module_params
    for owner in (layer, attn):
        for value in [*owner.parameters(recurse=False), *vars(owner).values()]:
            if isinstance(value, torch.Tensor) and value.requires_grad:
                return None  # a weight held by the layer itself (FSDP1 flat-parameter views)
    return params


def _is_idle_zero3_hook(attn, hook) -> bool:
    """DeepSpeed ZeRO-3 hooks every module; a module's hooks gather (and release, and prepare the
    backward of) only the parameters it holds itself, unless it is a ZeRO-3 leaf module. An attention
    module holding none gathers nothing: not calling its hooks skips nothing (the projections' own hooks
    run, we call them)."""
    return (
        (getattr(hook, "__module__", None) or "").startswith("deepspeed.")
        and hasattr(attn, "ds_id")
        and not getattr(attn, "_z3_leaf", False)
        and next(attn.parameters(recurse=False), None) is None
    )


def _foreign_attention_hooks(attn) -> bool:
    """Whether something other than transformers' output capturing or an idle ZeRO-3 hook hooks `attn`."""
    hooks = [*attn._forward_pre_hooks.values(), *attn._forward_hooks.values()]
    foreign = [
        hook
        for hook in hooks
        if getattr(hook, "__name__", "") != "output_capturing_hook" and not _is_idle_zero3_hook(attn, hook)
    ]
    return bool(foreign or attn._backward_hooks or attn._backward_pre_hooks or "forward" in attn.__dict__)


def _check_attention_hooks(attn) -> None:
    """The streamed path never calls `self_attn`: refuse if something other than transformers' output
    capturing (which we check separately) or an idle ZeRO-3 hook hooks it, since that hook would
    silently not run."""
    if _foreign_attention_hooks(attn):
        raise ValueError(
            f"{STREAMING_FIELD_NAME}: {type(attn).__name__} has hooks or a replaced forward (e.g. FSDP2 "
            "`fully_shard` on the attention module, or accelerate hooks); the streamed layer calls the attention's "
            "projections directly and those hooks would not run. Wrap whole decoder layers instead, or unset the field."
        )
    _check_output_attentions()


def _check_output_attentions() -> None:
    from ..utils.output_capturing import _active_collector

    collector = _active_collector.get()
    if collector is not None and "attentions" in collector:
        raise ValueError(
            f"{STREAMING_FIELD_NAME}: output_attentions=True is not supported in training with streaming backward "
            "(no full attention matrix is ever built). Request attentions in eval mode or unset the field."
        )


def _offload_requested(layer) -> bool:
    """Whether the layer's checkpointing, which streaming replaces, was enabled with offload=True (upstream's
    `activation_checkpointing_enable` tags the function it installs; patch 0013)."""
    return bool(layer.gradient_checkpointing and getattr(layer._gradient_checkpointing_func, "offload", False))


def _check_cache_is_empty(layer, cache) -> None:
    """A streamed layer neither reads nor fills the cache (`past_key_values`), as under upstream's gradient checkpointing, which
    streaming replaces: a training forward with the default `use_cache=True` returns the (empty) cache the model
    made, without the whole sequence's keys and values (their memory is what streaming saves). Cached tokens
    from an earlier call would be silently not attended to: refused."""
    cached = cache.get_seq_length(layer.self_attn.layer_idx) if cache is not None else 0
    if cached:
        raise ValueError(
            f"{STREAMING_FIELD_NAME}: the cache passed (`cache` / `past_key_values`) holds {cached} cached tokens, "
            "which a streamed layer cannot attend to (streamed training forwards neither read nor fill a cache). "
            "Train without a cache, or unset the field."
        )


def decoder_layer_forward(forward, layer, *args, **kwargs):
    """Streamed training forward of `layer` (`forward` is the layer class's own forward, for its signature)."""
    cls, layout = _layout(layer)
    if layout is None or generic.EVERY_LAYER:  # the layer's own forward, chunk by chunk (streaming_backward/)
        return generic.decoder_layer_forward(forward, layer, *args, **kwargs)
    bound = inspect.signature(forward).bind(layer, *args, **kwargs)
    arguments = dict(bound.arguments)
    extra = dict(arguments.pop("kwargs", {}))
    hidden_states = arguments["hidden_states"]
    if hidden_states.shape[0] == 0 or hidden_states.shape[1] == 0:
        raise ValueError(
            f"{STREAMING_FIELD_NAME}: the batch is empty (hidden_states of shape {tuple(hidden_states.shape)}); "
            "a training step needs at least one sequence of at least one token."
        )
    # Upstream 5.24 named the layer's cache argument `cache` (`past_key_values` before; still accepted, deprecated).
    legacy_cache = extra.pop("past_key_values", None)
    _check_cache_is_empty(layer, arguments.get("cache") if arguments.get("cache") is not None else legacy_cache)
    if "position_ids" in arguments:
        extra["position_ids"] = arguments["position_ids"]
    _check_attention_hooks(layer.self_attn)
    streamed = _StreamedLayer(
        layer,
        layout,
        sys.modules[cls.__module__],
        hidden_states,
        arguments.get("attention_mask"),
        arguments.get("position_embeddings"),
        extra,
    )
    streamed.plan_key_ranges()
    params = _layer_parameters(layer)
    offload = _offload_requested(layer)
    if params is None:
        if not offload:
            return _forward_with_checkpoints(streamed, hidden_states)
        # As upstream's checkpointing with offload=True does: what the checkpoints save goes to pinned host memory
        # (not pinned for CPU tensors: torch has no pinned allocator without an accelerator).
        on_accelerator = hidden_states.device.type != "cpu"
        with torch.autograd.graph.save_on_cpu(pin_memory=on_accelerator, device_type=hidden_states.device.type):
            return _forward_with_checkpoints(streamed, hidden_states)
    if not (hidden_states.requires_grad or params):
        return streamed.forward_without_graph(hidden_states)  # frozen layer, frozen input: nothing to keep
    return _StreamedLayerFunction.apply(hidden_states, streamed, offload, *params)

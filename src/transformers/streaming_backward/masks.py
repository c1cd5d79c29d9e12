"""Masks and key ranges of one query chunk of a streamed decoder layer (StreamBP, arXiv 2506.03077 §3.2.2).

A query chunk [start, end) reads keys [kv_start, kv_end): the causal prefix from the sliding window's first
key. Its mask is the exact slice of the layer's mask; when the model passed none (plainly causal SDPA) the
chunk gets a causal (or sliding-window) mask aligned bottom-right, built by `masking_utils.sdpa_mask` with
the chunk's offsets: SDPA's own `is_causal` aligns top-left and would be wrong for every chunk after the first.
"""

import bisect
import weakref

import torch
from torch.nn.attention.bias import CausalBias, CausalVariant, causal_lower_right
from torch.utils._python_dispatch import _disable_current_modes

from ..mst_core.fields import STREAMING_FIELD


# Extension point: an attention function registered with `AttentionInterface` whose attribute of this name is True,
# called with mask=None, masks an offset query chunk causally itself, aligned bottom-right (FlashAttention's
# convention), so a chunk needs no mask tensor. The planner's FlashAttention-like memory stand-in sets it
# (mst_planner/standins.py: its step must not allocate a [chunk, keys] mask).
BOTTOM_RIGHT_CAUSAL = "masks_offset_chunk_bottom_right"


def masks_offset_chunk_itself(implementation: str) -> bool:
    """Whether the attention function registered as `implementation` says it masks offset chunks itself."""
    from ..modeling_utils import ALL_ATTENTION_FUNCTIONS

    return bool(getattr(ALL_ATTENTION_FUNCTIONS.get(implementation), BOTTOM_RIGHT_CAUSAL, False))


def lower_right_causal_bias(q_len: int, kv_len: int):
    """torch's lower-right causal bias (a Tensor subclass holding only the sizes; `OwnKeysCausalBias` where torch's
    CPU kernels would materialize it), created with any active TorchDispatchMode (a memory tracker, FakeTensorMode)
    suspended: torch cannot create that subclass under one. The attention call itself runs under the modes as
    usual."""
    with _disable_current_modes():
        bias = causal_lower_right(q_len, kv_len)
        return OwnKeysCausalBias(CausalVariant.LOWER_RIGHT, bias.seq_len_q, bias.seq_len_kv)


# CPU dtypes `OwnKeysCausalBias` splits a chunk's attention for: its two partial outputs are merged in their own dtype,
# which in half precision would round the output twice (the unsplit kernel rounds it once).
SPLIT_DTYPES = (torch.float32, torch.float64)


def splits_on_cpu(dtype) -> bool:
    """Whether `OwnKeysCausalBias` splits a CPU query chunk of `dtype` itself (no mask tensor at all)."""
    return dtype in SPLIT_DTYPES


class OwnKeysCausalBias(CausalBias):
    """torch's lower-right causal bias (`causal_lower_right`), which SDPA receives as `attn_mask`. On a GPU it is
    torch's (FlashAttention's causal kernel, no mask tensor). On the CPU, where torch would materialize it as a
    [queries, keys] mask that its flash kernel adds block by block, a float32/64 query chunk after the first is
    attended in two calls of that kernel, on the keys before the chunk (no mask) and on its own keys (`is_causal`,
    a square), merged by their log-sum-exps (the split FlashAttention uses over key blocks, arXiv 2307.08691 §3.1);
    the backward calls the kernel's backward on each part with the merged output and log-sum-exp. Measured (CPU, 2
    threads, 4 heads of 64, 16K tokens, the chunks' forward): 1.16 s with chunks of 256 queries and 1.02 s with
    1024 (the unsplit causal kernel: 1.01 s), against 1.45 s and 1.58 s with torch's materialized bias."""

    @staticmethod
    def _dispatch(query, key, value, attn_mask, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        # The sizes the bias was made for (a single query's heads packed into its rows, as upstream's SDPA path does
        # for one query token under GQA, are not a chunk of queries: torch's bias handles them).
        sizes = (query.shape[-2], key.shape[-2]) == (attn_mask.seq_len_q, attn_mask.seq_len_kv)
        # Autocast casts SDPA's inputs to its dtype (they may differ: fp32 queries and keys after the rotary embedding,
        # bf16 values); torch's bias path below calls kernels that autocast does not cast, so the cast is done here.
        if torch.is_autocast_enabled(query.device.type):
            dtype = torch.get_autocast_dtype(query.device.type)
            query, key, value = (tensor.to(dtype) for tensor in (query, key, value))
        if (sizes and query.device.type == "cpu" and splits_on_cpu(query.dtype) and key.shape[-2] > query.shape[-2]
                and not dropout_p and not is_causal and not enable_gqa
                and key.shape[:-2] == query.shape[:-2] == value.shape[:-2]
                # torch's CPU flash kernel takes one head size; Multi-head Latent Attention's values have their own
                and query.shape[-1] == key.shape[-1] == value.shape[-1]):
            return _PrefixAndOwnKeysAttention.apply(query, key, value, scale)
        return CausalBias._dispatch(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


class _PrefixAndOwnKeysAttention(torch.autograd.Function):
    """Attention of q [B, H, C, D] over k, v [B, H, P + C, D], query i seeing keys <= P + i, in two calls of torch's
    CPU flash kernel (`OwnKeysCausalBias`)."""

    @staticmethod
    def forward(ctx, query, key, value, scale):
        prefix = key.shape[-2] - query.shape[-2]
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        out_prefix, lse_prefix = flash(query, key[..., :prefix, :], value[..., :prefix, :], 0.0, False, scale=scale)
        out_own, lse_own = flash(query, key[..., prefix:, :], value[..., prefix:, :], 0.0, True, scale=scale)
        lse = torch.logaddexp(lse_prefix, lse_own)  # [B, H, C]
        out = out_prefix * (lse_prefix - lse).exp().unsqueeze(-1) + out_own * (lse_own - lse).exp().unsqueeze(-1)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        prefix = key.shape[-2] - query.shape[-2]
        flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        grad_out = grad_out.contiguous()
        parts = [
            flash_backward(grad_out, query, key[..., keys, :], value[..., keys, :], out, lse, 0.0, causal, scale=ctx.scale)
            for keys, causal in ((slice(None, prefix), False), (slice(prefix, None), True))
        ]
        (grad_q_prefix, grad_k_prefix, grad_v_prefix), (grad_q_own, grad_k_own, grad_v_own) = parts
        del parts
        return (
            grad_q_prefix + grad_q_own,
            torch.cat([grad_k_prefix, grad_k_own], dim=-2),
            torch.cat([grad_v_prefix, grad_v_own], dim=-2),
            None,
        )


def sliding_window(attn):
    """The attention module's sliding window (Qwen2 / Gemma set it per layer; Mistral in the config), or None."""
    if hasattr(attn, "sliding_window"):
        return attn.sliding_window
    return getattr(attn.config, "sliding_window", None)


def allowed(mask_part: torch.Tensor) -> torch.Tensor:
    """Where a (bool or additive float) mask lets a query see a key."""
    if mask_part.dtype == torch.bool:
        return mask_part
    return mask_part > torch.finfo(mask_part.dtype).min / 2


def mask_allows(mask_part: torch.Tensor) -> bool:
    return mask_part.numel() > 0 and bool(allowed(mask_part).any())


def has_blind_row(mask_rows: torch.Tensor) -> bool:
    """Whether some query row of the mask allows no key at all."""
    return not bool(allowed(mask_rows).any(dim=-1).all())


def window_start(window, start: int) -> int:
    """First key a query chunk starting at `start` can see: 0, or the sliding window's first key."""
    return 0 if window is None else max(0, start - window + 1)


def plan_key_ranges(mask, chunks, window, seq_len):
    """(key ranges [(kv_start, kv_end)] per chunk, set of blind chunks). A blind chunk reads the whole sequence with
    its full mask rows, as the unsplit layer does: it holds a query row that sees no key at all (a left-padding
    position: eager softmax over an all-masked row is uniform over every key, and with left padding the last padding
    position predicts the first real label), or one that sees a key outside its causal prefix (a bidirectional
    block: Gemma-3's image tokens, a prefix-LM mask). layer.py runs such chunks' outputs once every key exists, and
    backpropagates them first."""
    key = (window, tuple(chunks), seq_len)
    if mask is not None:
        cached = _RANGES_CACHE.get(id(mask))
        if cached is not None and cached[0]() is mask and cached[1] == (mask._version, key):
            return cached[2]  # the layers share one mask per forward: read once, not per layer
    ranges, blind = [], set()
    for index, (start, end) in enumerate(chunks):
        kv_start = window_start(window, start)
        if mask is None:
            ranges.append((kv_start, end))
            continue
        rows = mask[:, :, start:end]
        outside = mask_allows(rows[..., end:]) or mask_allows(rows[..., :kv_start])
        if outside or has_blind_row(rows[..., kv_start:end]):
            kv_start, end = 0, seq_len
            blind.add(index)
        ranges.append((kv_start, end))
    if mask is not None:
        for stale in [k for k, (ref, *_) in _RANGES_CACHE.items() if ref() is None]:
            del _RANGES_CACHE[stale]
        _RANGES_CACHE[id(mask)] = (weakref.ref(mask), (mask._version, key), (ranges, blind))
    return ranges, blind


# id(mask) -> (weak reference to the mask, (its version, window, chunks, length), (key ranges, blind chunks)).
_RANGES_CACHE = {}


def chunk_mask(mask, batch, start, end, kv_start, kv_end, window, device, causal_bias=False):
    """Chunk [start, end)'s mask over keys [kv_start, kv_end): the slice of `mask`, or, with no mask (plainly
    causal SDPA), torch's lower-right causal bias (`causal_bias`) or the causal / sliding-window mask at the
    chunk's offsets (aligned bottom-right)."""
    if mask is not None:
        return mask[:, :, start:end, kv_start:kv_end]
    if causal_bias:
        return lower_right_causal_bias(end - start, kv_end - kv_start)
    from ..masking_utils import causal_mask_function, sdpa_mask, sliding_window_causal_mask_function

    mask_function = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    return sdpa_mask(
        batch_size=batch,
        q_length=end - start,
        kv_length=kv_end - kv_start,
        q_offset=start,
        kv_offset=kv_start,
        mask_function=mask_function,
        allow_is_causal_skip=False,
        device=device,
    )


class OffsetChunkMasks:
    """Additive float masks of the query chunks of one layer call where the model passed no mask (plainly causal, or
    a sliding window), as views of one [chunk, K] tensor built once: a chunk of `rows` queries ending at key `end`
    reading L keys gets `base[chunk - rows:, K - L:]`, column c being key end - K + c. On the CPU, torch's
    lower-right causal bias and `sdpa_mask` are materialized per chunk (a bool [chunk, keys] tensor, then SDPA's
    float copy of it); this view is neither. Measured (CPU, 2 threads, 4 heads of 64, 16K tokens): the chunks'
    attention forward 1.39 s (chunks of 256) and 1.20 s (1024) with the view, 1.45 s and 1.58 s with the bias.
    The values are SDPA's own for a bool mask: 0 where a query sees a key, -inf elsewhere."""

    def __init__(self, chunk, seq_len, window, dtype, device):
        self.chunk = chunk
        self.columns = seq_len if window is None else min(seq_len, chunk + window - 1)
        offset = self.columns - chunk  # query r sees columns c <= r + offset (key end - K + c <= its own position)
        allowed = torch.ones(chunk, self.columns, dtype=torch.bool, device=device).tril_(offset)
        if window is not None:  # ... and columns c > r + offset - window
            allowed.triu_(offset - window + 1)
        self.base = torch.zeros(chunk, self.columns, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))

    def view(self, rows, keys):
        """[1, 1, rows, keys]: the mask of a chunk of `rows` queries (the last ones of a full chunk) reading the `keys`
        keys up to its end."""
        return self.base[None, None, self.chunk - rows :, self.columns - keys :]


# FlashAttention's own packing inputs: a streamed layer gives them per chunk instead (`plan_flash_chunks`).
FLASH_VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def packed_sequence_starts(mask, kwargs, batch, seq_len):
    """Where packed sequences start, as upstream's FlashAttention path splits the batch (modeling_flash_attention_utils
    `_flash_attention_forward`): none with a padding mask (it unpads by the mask), else FlashAttention's own
    cu_seq_lens when given, else the restarts of position_ids (one row, as upstream requires). None if unpacked."""
    from ..modeling_flash_attention_utils import _is_packed_sequence, prepare_fa_kwargs_from_position_ids

    if mask is not None:
        return None
    if all(kwargs.get(name) is not None for name in FLASH_VARLEN_KWARGS):
        cu_q, cu_k = kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"]
        if cu_q.shape != cu_k.shape or not bool((cu_q == cu_k).all()) or int(cu_q[-1]) != batch * seq_len:
            raise ValueError(
                f"{STREAMING_FIELD}: cu_seq_lens_q and cu_seq_lens_k must both split the whole {batch} x {seq_len} "
                "tokens the same way (self-attention over packed sequences)."
            )
        if batch != 1:
            raise ValueError(f"{STREAMING_FIELD}: packed sequences (cu_seq_lens) need batch size 1, got {batch}.")
        return cu_q[:-1].tolist()
    position_ids = kwargs.get("position_ids")
    if _is_packed_sequence(position_ids, batch):
        (cu_q, _), _ = prepare_fa_kwargs_from_position_ids(position_ids)
        return cu_q[:-1].tolist()
    return None


def plan_flash_chunks(mask, chunks, window, sequence_starts, device):
    """(key ranges, FlashAttention kwargs, rows without a query) per chunk, for flash_attention_2 (>= 2.1).

    FlashAttention masks a chunk itself (causal aligned bottom-right, the window, per packed sequence), so a chunk
    reads the causal prefix from the window's first key, and from the first key of the packed sequence it starts in:
    its sequences then have consecutive key parts for cu_seq_lens_k. With a [batch, seq] padding mask the window
    counts unpadded tokens (upstream unpads first), so a chunk reads from key 0 there. A batch row with no real
    query in a chunk (all padding there) is named in the third list (a bool [batch] tensor, True = no query): the
    layer gives it all-ones mask columns and zero keys and values (`_ChunkCache`), so its attention output is 0 as
    upstream's padded rows get, and no kernel sees an empty query segment (varlen kernels have had bugs with those:
    Dao-AILab/flash-attention#1537, #2562)."""
    ranges, flash_kwargs, silent_rows = [], [], []
    for start, end in chunks:
        kv_start = 0 if mask is not None else window_start(window, start)
        kwargs, silent = {}, None
        if sequence_starts is not None:
            first = bisect.bisect_right(sequence_starts, start) - 1
            kv_start = max(kv_start, sequence_starts[first])
            inner = sequence_starts[first + 1 : bisect.bisect_left(sequence_starts, end)]
            q_edges, k_edges = [start, *inner, end], [kv_start, *inner, end]
            kwargs = {
                "cu_seq_lens_q": torch.tensor([e - start for e in q_edges], dtype=torch.int32, device=device),
                "cu_seq_lens_k": torch.tensor([e - kv_start for e in k_edges], dtype=torch.int32, device=device),
                "max_length_q": max(b - a for a, b in zip(q_edges, q_edges[1:])),
                "max_length_k": max(b - a for a, b in zip(k_edges, k_edges[1:])),
            }
        if mask is not None:
            no_query = ~mask[:, start:end].bool().any(dim=-1)
            if bool(no_query.any()):
                silent = no_query
        ranges.append((kv_start, end))
        flash_kwargs.append(kwargs)
        silent_rows.append(silent)
    return ranges, flash_kwargs, silent_rows


def flash_chunk_mask(mask, kv_start, kv_end, silent):
    """Chunk's [batch, keys] padding mask for FlashAttention; rows without a query (`silent`) get all ones."""
    if mask is None:
        return None
    part = mask[:, kv_start:kv_end]
    if silent is None:
        return part
    return part.masked_fill(silent[:, None], 1)

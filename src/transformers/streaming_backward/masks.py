"""Masks and key ranges of one query chunk of a streamed decoder layer (StreamBP, arXiv 2506.03077 §3.2.2).

A query chunk [start, end) reads keys [kv_start, kv_end): the causal prefix from the sliding window's first
key. Its mask is the exact slice of the layer's mask; when the model passed none (plainly causal SDPA) the
chunk gets a causal (or sliding-window) mask aligned bottom-right, built by `masking_utils.sdpa_mask` with
the chunk's offsets: SDPA's own `is_causal` aligns top-left and would be wrong for every chunk after the first.
"""

import weakref

import torch

from ..mini_sequence.config import STREAMING_FIELD_NAME


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
    """(key ranges [(kv_start, kv_end)] per chunk, set of blind chunks). Raises if the mask lets a query see a key
    outside its causal prefix (prefix-LM or custom masks: slicing would drop those keys). A chunk holding a query
    row that sees no key at all (a left-padding position) reads the whole sequence with its full mask rows, as the
    unsplit layer does (eager softmax over an all-masked row is uniform over every key, and with left padding the
    last padding position predicts the first real label)."""
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
        if mask_allows(rows[..., end:]) or mask_allows(rows[..., :kv_start]):
            raise ValueError(
                f"{STREAMING_FIELD_NAME}: the attention mask lets query tokens {start}..{end - 1} see keys outside "
                f"their causal prefix [{kv_start}, {end}); streaming backward supports causal (and sliding-window) "
                "masks only. Unset the field for this model."
            )
        if has_blind_row(rows[..., kv_start:end]):
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
        from ..mini_sequence.streaming import _lower_right_causal_bias

        return _lower_right_causal_bias(end - start, kv_end - kv_start)
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

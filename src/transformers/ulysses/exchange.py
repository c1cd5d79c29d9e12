"""The all-to-alls of DeepSpeed-Ulysses, ours: between one rank's shard of the sequence for all heads and the whole
sequence for its share of the heads (ranks hold contiguous shards: rank r tokens [r L, (r + 1) L)).

DeepSpeed's `UlyssesSPAttentionHF` is built for one head size and one key/value head count, the text config's; a layer
with others (Gemma-4's full-attention layers: their own head size and key/value heads) goes through
`whole_sequence_attention` here instead, and a streamed layer's query chunks through streamed.py.
"""

from __future__ import annotations

import torch


def all_to_all(tensor: torch.Tensor, group) -> torch.Tensor:
    """Part i of dim 0 (size sp) to rank i; dim 0 of the result: the part each rank sent here. Differentiable (its
    backward is the reverse all-to-all), by torch's functional collectives, which torch.distributed.nn's deprecated
    all_to_all_single names as its replacement."""
    from torch.distributed import _functional_collectives as collectives

    return collectives.wait_tensor(collectives.all_to_all_single_autograd(tensor.contiguous(), None, None, group))


def heads_to_sequence(tensor: torch.Tensor, sp: int, group) -> torch.Tensor:
    """[B, H, L, D] of this shard -> [B, H/sp, sp L, D]: the whole sequence for this rank's heads."""
    b, h, length, d = tensor.shape
    if h % sp:
        raise ValueError(f"Ulysses: {h} heads cannot be split over sp_size={sp} ranks (tensor of shape {tuple(tensor.shape)})")
    parts = all_to_all(tensor.view(b, sp, h // sp, length, d).transpose(0, 1), group)  # [sp shards, B, H/sp, L, D]
    return parts.permute(1, 2, 0, 3, 4).reshape(b, h // sp, sp * length, d)


def sequence_to_heads(tensor: torch.Tensor, sp: int, group) -> torch.Tensor:
    """The inverse of `heads_to_sequence`: [B, H/sp, sp L, D] -> [B, H, L, D]."""
    b, heads, whole, d = tensor.shape
    length = whole // sp
    parts = tensor.view(b, heads, sp, length, d).permute(2, 0, 1, 3, 4)  # [sp shards, B, H/sp, L, D]
    return all_to_all(parts, group).transpose(0, 1).reshape(b, sp * heads, length, d)


def gather_sequence(tensor: torch.Tensor, group) -> torch.Tensor:
    """[B, 1, L, D] of this shard -> [B, 1, sp L, D], every rank's shard in rank order (differentiable: its backward
    sums the ranks' gradients of each shard, a reduce-scatter). For tensors that hold no heads to split: Multi-head
    Latent Attention's cached latents, which every query head reads."""
    from torch.distributed import _functional_collectives as collectives

    return collectives.wait_tensor(collectives.all_gather_tensor_autograd(tensor.contiguous(), 2, group))


def scatter_sequence_grad(grad: torch.Tensor, group) -> torch.Tensor:
    """The adjoint of `gather_sequence` (no graph): [B, 1, sp L, D] -> this shard's [B, 1, L, D], summed over ranks."""
    from torch.distributed import _functional_collectives as collectives

    return collectives.wait_tensor(collectives.reduce_scatter_tensor(grad.contiguous(), "sum", 2, group))


def fits_deepspeed(uattn, query, key, value) -> bool:
    """Whether DeepSpeed's module was built for these shapes ([B, H, L, D]: its head count and size, its key/value
    head count)."""
    return (query.shape[1] == uattn.attn_head_count and key.shape[1] == uattn.global_kv_head_count
            and query.shape[-1] == key.shape[-1] == value.shape[-1] == uattn.attn_head_size)


def whole_sequence_attention(module, query, key, value, attention_mask, positions, core, uattn, args, kwargs):
    """What DeepSpeed's module does, for any head size: q/k/v to the whole sequence for this rank's heads, `core`
    (which rebuilds the whole sequence's mask) with the gathered `positions`, the output back to this shard.
    Key/value heads must be divisible by sp (no replication)."""
    sp, group = uattn.world_size, uattn.process_group
    if key.shape[1] % sp:
        raise ValueError(
            f"Ulysses sequence parallelism (sp_size={sp}): {type(module).__name__} has {key.shape[1]} key/value heads "
            f"of size {key.shape[-1]}, not the {uattn.global_kv_head_count} of size {uattn.attn_head_size} DeepSpeed's "
            f"module was built for; transformers-mst exchanges such a layer's heads itself, and needs them divisible "
            f"by {sp}. Use an sp_size dividing them."
        )
    q, k, v = (heads_to_sequence(t, sp, group) for t in (query, key, value))
    out, weights = core(module, q, k, v, attention_mask, *args, **{**kwargs, "position_ids": positions})
    return sequence_to_heads(out.transpose(1, 2), sp, group).transpose(1, 2), weights  # [B, L, H, D]

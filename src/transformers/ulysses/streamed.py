"""A streamed layer's query chunk under DeepSpeed-Ulysses (the seam: mst_core/sharded_sequence.py).

Rank r holds tokens [r L, (r + 1) L) of the sequence (L = S/sp). Its streamed layer (streaming_backward/layer.py) runs
query rows [start, end) of its shard at a time, every rank the same rows of its own shard at once, and hands the
attention the whole sequence's keys and values for this rank's heads, gathered once per pass. Here the chunk's
queries go through the all-to-all (each rank gets the chunk's rows of every shard for its H/sp heads: sp blocks of
rows, r L + [start, end)); each block attends to the keys before its end with the rows of the whole sequence's mask,
which `UlyssesMask` rebuilds exactly as for the unsplit sequence (masks.py); the blocks' outputs go back through the
second all-to-all. The core attention is DeepSpeed's (upstream's SDPA), called once per block. So a layer's recompute
holds one chunk's activations per rank, and the K/V of the whole sequence for 1/sp of the heads. Multi-head Latent
Attention caches latents with no heads to split: the cache hands every rank the whole sequence's (masks.py), and each
rank's chunk attends its own rows with every head, no all-to-all.
"""

from __future__ import annotations

import torch

from .exchange import heads_to_sequence, sequence_to_heads

# Core attention implementations a streamed query chunk runs with: SDPA takes the blocks' bottom-right causal masks;
# FlashAttention's packed-sequence path reads position_ids of the query and key rows as one sequence.
STREAMABLE_ATTENTION = ("sdpa",)


class StreamedQueryChunk:
    """The attention mask a streamed layer passes for its shard's query rows [start, end) (ShardedSequenceMask.
    query_chunk): the Ulysses attention recognises it and calls `attend`."""

    def __init__(self, mask, start: int, end: int, position_ids, causal_bias):
        self.mask, self.start, self.end = mask, start, end
        self.position_ids, self.causal_bias = position_ids, causal_bias

    def __repr__(self):
        return f"StreamedQueryChunk(rows {self.start}:{self.end} of every shard, {self.mask!r})"

    def attend(self, module, query, keys, values, core, uattn, args, kwargs):
        """query [B, H, C, D] of this shard's rows [start, end); keys/values [B, H_kv/sp, S, D] (gathered) ->
        ([B, C, H, D], None), as an attention function returns. Keys and values of every query head (expanded from
        the whole sequence's latents, masks.py `gather_keys_values`): the chunk's own rows attend them here, with no
        all-to-all."""
        sp, group = uattn.world_size, uattn.process_group
        b, h, c, d = query.shape
        length = self.mask.q_length
        whole_length = length * sp
        if keys.shape[-2] != whole_length:
            raise RuntimeError(
                f"Ulysses streaming: the cache handed the attention {keys.shape[-2]} keys, not the whole sequence's "
                f"{whole_length}; please report this with your setup."
            )
        positions = self.mask.gathered_positions(self.position_ids, uattn)
        shape_like = query.new_empty((b, 1, whole_length, 0))
        whole_mask = self.mask.build(module, shape_like, {**kwargs, "position_ids": positions}, uattn)

        def block(queries, first, last):  # rows [first, last) of the whole sequence -> [B, C, heads, D]
            if whole_mask is None:  # plainly causal: the keys before the block's end, aligned bottom-right
                kv_end, block_mask = last, self.causal_bias(c, last)
            else:
                rows = whole_mask[:, :, first:last]
                allowed = rows if rows.dtype == torch.bool else rows == 0
                # A row that sees no key (left padding) reads every key with its whole row, as the unsplit call does.
                kv_end = last if bool(allowed[..., :last].any(-1).all()) else whole_length
                block_mask = rows[..., :kv_end]
            out, _ = core(module, queries, keys[:, :, :kv_end], values[:, :, :kv_end], block_mask, *args, **kwargs)
            return out

        # Every head's keys (expanded from the whole sequence's latents): exchanged ones would be H_kv/sp < H heads.
        # Read from the shapes, not from the mask's `latents_gathered`: a checkpointed chunk's recompute (ZeRO-3)
        # may run after another layer's gather.
        if keys.shape[1] == h:
            return block(query, self.mask.first_token + self.start, self.mask.first_token + self.end), None
        blocks = heads_to_sequence(query, sp, group)  # [B, H/sp, sp C, D]: rank i's rows at [i C, (i + 1) C)
        outputs = [
            block(blocks[:, :, shard * c : (shard + 1) * c], shard * length + self.start, shard * length + self.end)
            .transpose(1, 2)  # [B, H/sp, C, D]
            for shard in range(sp)
        ]
        out = torch.cat(outputs, dim=2)  # [B, H/sp, sp C, D]
        del outputs, blocks
        return sequence_to_heads(out, sp, group).transpose(1, 2), None  # [B, C, H, D]

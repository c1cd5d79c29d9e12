"""The seam between sequence parallelism (ulysses/) and a streamed decoder layer (streaming_backward/).

Under DeepSpeed-Ulysses each rank holds one contiguous shard of the sequence, S/sp tokens, and its attention sees the
whole sequence for H/sp of the heads (an all-to-all before and after the core attention). A decoder layer there gets
a `ShardedSequenceMask` as its attention mask. A streamed layer that gets one runs each query chunk of its shard
against the keys of the whole sequence: it computes its shard's keys and values first (the layer stopped at its cache),
turns them into the whole sequence's for its share of the heads once per pass (`gather_keys_values`), and passes
`query_chunk(...)` as each chunk's attention mask. The attention function that made the mask then attends the chunk's
queries of every rank to the gathered keys, with the rows of the whole sequence's mask. Neither package imports the
other: both import this module.
"""

from __future__ import annotations


class ShardedSequenceMask:
    """A decoder layer's attention mask when its input is one shard of the sequence (subclassed by ulysses/masks.py)."""

    world_size: int  # ranks sharing the sequence
    q_length: int  # this rank's tokens
    first_token: int  # the sequence's tokens before this rank's shard (a streamed chunk numbers its queries from it)

    def check_streamable(self, attention_module) -> None:
        """Raise (naming the setting and what is allowed) unless a streamed layer can run query chunks through this
        attention module here; called before the layer computes anything."""
        raise NotImplementedError

    def gather_keys_values(self, keys, values):
        """This shard's keys and values [B, H_kv, S/sp, D] -> the whole sequence's for this rank's heads,
        [B, H_kv/sp, S, D] (differentiable: its backward returns the gradients to the ranks that computed them)."""
        raise NotImplementedError

    def scatter_grad(self, grad):
        """The adjoint of `gather_keys_values` for one of them: a gradient [B, H_kv/sp, S, D] -> this shard's
        [B, H_kv, S/sp, D]."""
        raise NotImplementedError

    def query_chunk(self, start: int, end: int, position_ids, causal_bias):
        """The attention mask to pass for this shard's query rows [start, end) when the cache hands the attention the
        gathered keys and values. `position_ids`: the layer call's [B, S/sp] (the whole shard's); `causal_bias(q_len,
        kv_len)`: a lower-right causal mask object for a plainly causal block (streaming_backward/masks.py)."""
        raise NotImplementedError

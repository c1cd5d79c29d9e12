"""The backward of a streamed attention layer (layer.py's `StreamedLayerFunction`), one `LayerBackward` per call: the
order of its chunks' turns and the K/V their caches hold; each turn is the chunk driver's (driver.py).

First every chunk's K/V again, without graph (the layer stopped at the cache: the K/V pass); under Ulysses turned into
the whole sequence's for this rank's heads. Then the chunks holding a blind query row, their outputs first (every key
a leaf: cache.BackwardCache). Then every chunk from the last: recomputed once with graph, its attention reading the K/V
buffers through a cache.JoinedCache, one `autograd.grad` taking its output's gradient and routing the K/V gradients
of earlier rows into their row-block sums (rows.py), whose block is final, and freed, at its first chunk's turn. A
mixer beside the attention (Falcon-H1) starts each chunk from its start states as leaves and hands their gradients
to the chunk before as those of its end states (states.py). The module docstring of layer.py says why this is exact.
"""

import torch

from .cache import BackwardCache, JoinedCache
from .driver import ChunksBackward
from .rows import RowBlocks, row_blocks


class LayerBackward(ChunksBackward):
    """The gradients of one streamed attention layer call, from the Function's `ctx` and the output's gradient."""

    def __init__(self, ctx, grad_out, grad_router_logits):
        super().__init__(ctx, ctx.streamed, grad_out, grad_router_logits)
        self.streamed = ctx.streamed
        # Set by `run`: the K/V buffers, their gradient sums by row block (`grad_keys`, `grad_values`), the blocks.
        self.keys = self.values = None
        self.blocks, self.block_starting_at = None, None

    def run(self):
        """(the input's gradient, None, None, the row inputs', the parameters'), as the Function's backward returns."""
        streamed = self.streamed
        with self.summing(), streamed.views_of_one_mask():
            self._keys_values()
            # Chunks holding a blind query row (they read keys after their own rows): their outputs first, every key
            # of their range a leaf; their end states take their gradients at their turn.
            for index in sorted(streamed.blind):
                self._chunk_backward(index, self._leaves_cache(index), streamed.chunk_rng[index], end_states=False)
            if streamed.sharded is not None:  # the whole sequence's dK/dV -> this shard's rows, one at a time
                self.keys = self.values = None  # the gathered K/V: below, each chunk's own K/V alone (stopped at the cache)
                self.grad_keys, self.grad_values = (
                    RowBlocks.holding(streamed.chunks, self.blocks, streamed.sharded.scatter_grad(total.pop_or_zeros(0)),
                                      dim=2)
                    for total in (self.grad_keys, self.grad_values)
                )
            # Then every chunk from the last: chunk i adds only to rows before its end, so its own rows' dK/dV are
            # final at its turn, and one backward takes its output and its own K/V. A blind chunk's own K/V: the
            # layer stopped at the cache.
            for index in reversed(range(len(streamed.chunks))):
                start, end = streamed.chunks[index]
                if index in streamed.blind:  # its own K/V alone: the state of the forward pass that wrote them
                    self._chunk_backward(index, self._leaves_cache(index, stop=True), streamed.keys_values_rng(index),
                                         outputs=False, own_keys_values=True)
                else:
                    kv_start = streamed.key_ranges[index][0]
                    cache = JoinedCache(self.keys, self.values, start, end, kv_start, (self.grad_keys, self.grad_values))
                    self._chunk_backward(index, cache, streamed.chunk_rng[index])
                self._release_final_rows(index)
                streamed.recorded_projections.release(index)
                if streamed.starts is not None and index > 0:  # the chunk before ends where this one starts
                    self.pass_states_back(index)
            self.keys = self.values = None
            if self.grad_keys.parts or self.grad_values.parts:  # rows added to after their chunks' turn: a lost gradient
                raise RuntimeError(
                    f"streaming backward: K/V gradients of row blocks {sorted(self.grad_keys.parts)} were never "
                    "backpropagated; refusing to return incomplete gradients. Please report this with your setup."
                )
        return self._gradients()

    def _keys_values(self):
        """Every chunk's K/V, without graph, and their gradient sums: dK/dV summed over chunks (in fp32 for
        half-precision K/V), one tensor per row block."""
        streamed = self.streamed
        buffers = [None, None, streamed.seq_len]
        with torch.no_grad():
            streamed.keys_values_only(self.x.rows, buffers)
        keys, values = buffers[0], buffers[1]
        sum_dtype = torch.float32 if keys.dtype in (torch.float16, torch.bfloat16) else keys.dtype
        self.blocks = row_blocks(streamed.chunks)
        if streamed.sharded is not None:
            # Every chunk reads the whole sequence's K/V for this rank's heads: their dK/dV are summed there, in one
            # block, and come back to this shard's rows once every chunk's output is done (`run`).
            with torch.no_grad():
                keys, values = streamed.sharded.gather_keys_values(keys, values)
            buffers[0] = buffers[1] = None  # this shard's K/V: its chunks' own are recomputed
            self.blocks = [[0, len(streamed.chunks)]]
            whole = [(0, keys.shape[2])]
            self.grad_keys = RowBlocks(whole, [[0, 1]], keys, dim=2, dtype=sum_dtype)
            self.grad_values = RowBlocks(whole, [[0, 1]], values, dim=2, dtype=sum_dtype)
        else:
            self.grad_keys = RowBlocks(streamed.chunks, self.blocks, keys, dim=2, dtype=sum_dtype)
            self.grad_values = RowBlocks(streamed.chunks, self.blocks, values, dim=2, dtype=sum_dtype)
        self.keys, self.values = keys, values
        self.block_starting_at = {first: block for block, (first, _) in enumerate(self.blocks)}

    def _leaves_cache(self, index, stop=False):
        start, end = self.streamed.chunks[index]
        return BackwardCache(self.keys, self.values, start, end, *self.streamed.key_ranges[index], stop=stop)

    def _release_final_rows(self, index):
        if index in self.block_starting_at:
            self.grad_keys.pop(self.block_starting_at[index])
            self.grad_values.pop(self.block_starting_at[index])

    def input_rows(self, like, dtype):
        """The input gradient by row blocks, grown block by block as the chunks' turns reach them."""
        return RowBlocks(self.streamed.chunks, self.blocks, like, dim=1, dtype=dtype)

    def replaying(self, index, rng, linear_sums):
        """The projections before the cache return what the K/V pass computed (projections.py), where this pass
        replays that pass's RNG state: not a blind chunk's output, drawn in a pass of its own."""
        if rng is self.streamed.keys_values_rng(index):
            return self.streamed.recorded_projections.replaying(index, linear_sums)
        return super().replaying(index, rng, linear_sums)

    def _gradients(self):
        for name, total in self.row_grads.items():
            if total is None:
                raise RuntimeError(
                    f"streaming backward: {type(self.streamed.layer).__name__}'s argument {name!r} requires grad and "
                    "got no gradient from the recomputation; refusing to return a missing gradient."
                )
        return super()._gradients()

"""The `Cache` seam of a streamed decoder layer.

Every attention module of transformers 5.24 calls `cache.update(key_states, value_states, layer_idx, ...)` after
its K-norm and RoPE and before `repeat_kv` and the attention function, and attends to what `update` returns. A
streamed layer runs the decoder layer's own forward on one query chunk at a time and passes one of these objects
as its cache: `update` is where the chunk's keys/values meet the earlier tokens'.
"""

import torch


class StopAfterKeysValues(Exception):
    """Raised by a cache that only wants the chunk's keys and values: the rest of the layer is not run."""


class _ChunkCache:
    """Duck-typed `Cache`: attention modules only call `update` on it."""

    is_compileable = False
    # Bool [batch] of FlashAttention rows without a query in the chunk (masks.plan_flash_chunks), or None: their
    # values are returned as zeros, so their attention output is 0 as upstream's padded rows get.
    silent_rows = None

    def __init__(self):
        self.updated = False

    def get_seq_length(self, layer_idx=0):
        return 0

    def update(self, key_states, value_states, layer_idx=None, *args, **kwargs):
        self.updated = True
        keys, values = self._update(key_states, value_states)
        if self.silent_rows is not None:
            values = values.masked_fill(self.silent_rows[:, None, None, None], 0)
        return keys, values


class RecordingCache(_ChunkCache):
    """Forward (no graph): writes chunk [start, end)'s K/V into full-sequence buffers and returns K/V[kv_start:kv_end].
    With `stop=True` it raises `StopAfterKeysValues` after writing (a chunk whose keys reach past its own end, run
    again once every key exists)."""

    def __init__(self, buffers, start, end, kv_start, kv_end, stop=False):
        super().__init__()
        self.buffers, self.start, self.end, self.kv_start, self.kv_end, self.stop = buffers, start, end, kv_start, kv_end, stop

    def _update(self, keys, values):
        if self.buffers[0] is None:
            seq_len = self.buffers[2]
            self.buffers[0] = keys.new_empty(keys.shape[:2] + (seq_len,) + keys.shape[3:])
            self.buffers[1] = values.new_empty(values.shape[:2] + (seq_len,) + values.shape[3:])
        all_keys, all_values = self.buffers[0], self.buffers[1]
        if keys.shape[2] != self.end - self.start:
            raise RuntimeError("streaming backward: the attention passed the cache keys of another length than its chunk.")
        all_keys[:, :, self.start : self.end].copy_(keys)
        all_values[:, :, self.start : self.end].copy_(values)
        if self.stop:
            raise StopAfterKeysValues
        return all_keys[:, :, self.kv_start : self.kv_end], all_values[:, :, self.kv_start : self.kv_end]


class BackwardCache(_ChunkCache):
    """Backward recomputation of chunk [start, end): records the chunk's K/V (with graph) and returns them
    concatenated with the other keys of its range as detached leaves (`self.leaves`: their gradients are the
    dK/dV this chunk adds to earlier tokens). `own_as_leaf=True` returns the chunk's own rows as leaves too (a
    blind chunk's output pass: its own K/V are backpropagated later). `stop=True` raises after recording."""

    def __init__(self, all_keys, all_values, start, end, kv_start, kv_end, own_as_leaf=False, stop=False):
        super().__init__()
        self.keys = self.values = None
        self.stop = stop
        if own_as_leaf:
            self.leaves = [all_keys[:, :, kv_start:kv_end].detach().requires_grad_(),
                           all_values[:, :, kv_start:kv_end].detach().requires_grad_()]
            self.parts = None
        else:
            self.parts = (kv_start, start, end, kv_end)
            before = (all_keys[:, :, kv_start:start], all_values[:, :, kv_start:start])
            after = (all_keys[:, :, end:kv_end], all_values[:, :, end:kv_end])
            self.before = [t.detach().requires_grad_() for t in before] if start > kv_start else None
            self.after = [t.detach().requires_grad_() for t in after] if kv_end > end else None

    def _update(self, keys, values):
        self.keys, self.values = keys, values
        if self.stop:
            raise StopAfterKeysValues
        if self.parts is None:
            return self.leaves[0], self.leaves[1]
        out_k, out_v = [keys], [values]
        if self.before is not None:
            out_k.insert(0, self.before[0])
            out_v.insert(0, self.before[1])
        if self.after is not None:
            out_k.append(self.after[0])
            out_v.append(self.after[1])
        if len(out_k) == 1:
            return keys, values
        return torch.cat(out_k, dim=2), torch.cat(out_v, dim=2)


class FixedCache(_ChunkCache):
    """Returns given keys/values (with graph): the autograd fallback, whose K/V come from a pass of their own."""

    def __init__(self, keys, values):
        super().__init__()
        self.keys, self.values = keys, values

    def _update(self, keys, values):
        return self.keys, self.values

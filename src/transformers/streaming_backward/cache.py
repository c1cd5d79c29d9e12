"""The `Cache` seam of a streamed decoder layer.

Every attention module of transformers 5.24 calls `cache.update(key_states, value_states, layer_idx, ...)` after
its K-norm and RoPE and before `repeat_kv` and the attention function, and attends to what `update` returns. A
streamed layer runs the decoder layer's own forward on one query chunk at a time and passes one of these objects
as its cache: `update` is where the chunk's keys/values meet the earlier tokens'.
"""

import contextlib

import torch


class StopAfterKeysValues(Exception):
    """Raised by a cache that only wants the chunk's keys and values: the rest of the layer is not run."""


class _ChunkCache:
    """Duck-typed `Cache`: attention modules call `update` on it, and Llama-4's NoPE layers `get_seq_length`, from
    which they number their queries (the temperature tuning of arXiv 2501.19399): the tokens before the chunk, as a
    cache holding them would say."""

    is_compileable = False
    # Bool [batch] of FlashAttention rows without a query in the chunk (masks.plan_flash_chunks), or None: their
    # keys and values are returned as zeros, so their attention output is 0 as upstream's padded rows get (a padded
    # position's output counts: under left padding it predicts the first real token). Keys too: Multi-head Latent
    # Attention (DeepSeek-V2/V3) caches latents and expands them into keys and values after the cache by a bias-free
    # linear map (`kv_b_proj`), so only zero latents give zero values.
    silent_rows = None
    stop = False  # raises StopAfterKeysValues once it has the chunk's K/V: the attention never runs
    tokens_before = 0  # the query chunk's first position (set by the streamed layer's `call`)

    def __init__(self):
        self.updated = False

    def get_seq_length(self, layer_idx=0):
        return self.tokens_before

    def update(self, key_states, value_states, layer_idx=None, *args, **kwargs):
        self.updated, self.keys_dtype = True, key_states.dtype
        keys, values = self._update(key_states, value_states)
        if self.silent_rows is not None:
            silent = self.silent_rows[:, None, None, None]
            keys, values = keys.masked_fill(silent, 0), values.masked_fill(silent, 0)
        return keys, values


class RecordingCache(_ChunkCache):
    """Forward (no graph): writes chunk [start, end)'s K/V into full-sequence buffers and returns K/V[kv_start:kv_end].
    With `stop=True` it raises `StopAfterKeysValues` after writing (a chunk whose keys reach past its own end, run
    again once every key exists). `write=False` keeps what an earlier pass wrote for the chunk's rows (that second
    run: every reader then sees one K/V for them, whatever dropout draws)."""

    def __init__(self, buffers, start, end, kv_start, kv_end, stop=False, write=True):
        super().__init__()
        self.buffers, self.start, self.end, self.kv_start, self.kv_end = buffers, start, end, kv_start, kv_end
        self.stop, self.write = stop, write

    def _update(self, keys, values):
        if self.buffers[0] is None:
            seq_len = self.buffers[2]
            self.buffers[0] = keys.new_empty(keys.shape[:2] + (seq_len,) + keys.shape[3:])
            self.buffers[1] = values.new_empty(values.shape[:2] + (seq_len,) + values.shape[3:])
        all_keys, all_values = self.buffers[0], self.buffers[1]
        if keys.shape[2] != self.end - self.start:
            raise RuntimeError("streaming backward: the attention passed the cache keys of another length than its chunk.")
        if self.write:
            all_keys[:, :, self.start : self.end].copy_(keys)
            all_values[:, :, self.start : self.end].copy_(values)
        if self.stop:
            raise StopAfterKeysValues
        return all_keys[:, :, self.kv_start : self.kv_end], all_values[:, :, self.kv_start : self.kv_end]


class BackwardCache(_ChunkCache):
    """Backward recomputation of a chunk that reads keys after its own rows (a blind chunk, layer.py): records the
    chunk's K/V (with graph: `keys`, `values`) and returns the K/V buffers' rows [kv_start, kv_end) as detached
    leaves (`leaves`; views, no copy), whose gradients the caller adds into dK/dV. `stop=True` raises after
    recording: the chunk's own K/V pass at its turn, once its rows' dK/dV are final."""

    def __init__(self, all_keys, all_values, start, end, kv_start, kv_end, stop=False):
        super().__init__()
        self.keys = self.values = None
        self.stop = stop
        self.leaves = None if stop else [
            all_keys[:, :, kv_start:kv_end].detach().requires_grad_(),
            all_values[:, :, kv_start:kv_end].detach().requires_grad_(),
        ]

    def _update(self, keys, values):
        self.keys, self.values = keys, values
        if self.stop:
            raise StopAfterKeysValues
        return self.leaves[0], self.leaves[1]


class JoinedCache(_ChunkCache):
    """Backward recomputation of chunk [start, end) that reads keys [kv_start, end): returns the K/V buffers' rows
    [kv_start, end) (views, no copy), joined by `_JoinRows` to the K/V the layer computed for the chunk's own rows.
    In the backward the gradient of the earlier rows is added into the dK/dV sums (`sinks`, rows.RowBlocks), and
    that of its own rows, plus what later chunks summed there, goes back through the layer's own K/V projections,
    norms and RoPE, all in the chunk's one `autograd.grad`."""

    def __init__(self, all_keys, all_values, start, end, kv_start, sinks):
        super().__init__()
        self.keys = self.values = None
        self.rows = (all_keys[:, :, kv_start:end], all_values[:, :, kv_start:end])
        self.sinks, self.span = sinks, (kv_start, start, end)
        self.leaves = []

    def _update(self, keys, values):
        self.keys, self.values = keys, values
        return tuple(_JoinRows.apply(own, rows, sink, *self.span) for own, rows, sink in zip((keys, values), self.rows, self.sinks))


class _JoinRows(torch.autograd.Function):
    """Forward: the buffer's rows [kv_start, end) (equal to `own` on [start, end): recorded in the forward). Backward:
    rows [kv_start, start) of the gradient into `sink`; rows [start, end) plus the sink's (final) rows to `own`."""

    @staticmethod
    def forward(ctx, own, rows, sink, kv_start, start, end):
        ctx.sink, ctx.span = sink, (kv_start, start, end)
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx, grad):
        kv_start, start, end = ctx.span
        if start > kv_start:
            ctx.sink.add(grad[:, :, : start - kv_start], kv_start, start)
        own = grad[:, :, start - kv_start :]
        total = ctx.sink.rows(start, end, torch.promote_types(own.dtype, ctx.sink.dtype))
        return (total + own).to(grad.dtype), None, None, None, None, None


class FixedCache(_ChunkCache):
    """Returns given keys/values (with graph): the autograd fallback, whose K/V come from a pass of their own."""

    def __init__(self, keys, values):
        super().__init__()
        self.keys, self.values = keys, values

    def _update(self, keys, values):
        return self.keys, self.values


def runs_its_class_forward(module) -> bool:
    """Whether calling `module` runs its class's `forward` and nothing else: no hooks of its own, no `forward` set on
    the instance (a pass of ours may swap that forward: queries_not_computed, projections.py)."""
    return not (module._forward_hooks or module._forward_pre_hooks or "forward" in vars(module))


def discardable_query_projection(attn, hooks_run=False):
    """`attn.q_proj` if a pass that stops at the cache may skip it (its queries are never read), else None.

    Only where skipping changes nothing else: a module with `out_features` (nn.Linear, a PEFT LoRA layer, a 4-bit
    Linear), no hooks of its own and no dropout with p > 0 inside (a K/V pass replays the forward's RNG state: a
    skipped dropout draw would shift those of k_proj/v_proj, e.g. LoRA dropout). A fused projection (Phi-3's `qkv_proj`)
    computes the keys too: not skipped. With `hooks_run` (the autograd fallback under a wrapper's hooks, layer.py) a
    module with hooks is skipped too: it is still called, its hooks run (ZeRO-3 gathers and releases its weight), and
    only its product is not done (no forward set on the instance: accelerate's hooks live there)."""
    projection = getattr(attn, "q_proj", None)
    if not isinstance(projection, torch.nn.Module) or not isinstance(getattr(projection, "out_features", None), int):
        return None
    if "forward" in vars(projection) or not (hooks_run or runs_its_class_forward(projection)):
        return None
    if any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in projection.modules()):
        return None
    return projection


@contextlib.contextmanager
def queries_not_computed(projection):
    """While the layer runs only up to the cache, `projection` (discardable_query_projection) returns zeros of its
    output's shape instead of multiplying, so the query projection sees each token twice a step (the forward and the
    chunk's recompute), as under checkpointing, and not a third time in the backward's K/V pass."""
    if projection is None:
        yield
        return

    def zeros(x, *args, **kwargs):
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        return x.new_zeros(x.shape[:-1] + (projection.out_features,), dtype=dtype)

    projection.forward = zeros
    try:
        yield
    finally:
        del projection.forward

"""The backward of a streamed attention layer (layer.py's `StreamedLayerFunction`), one `LayerBackward` per call.

First every chunk's K/V again, without graph (the layer stopped at the cache: the K/V pass); under Ulysses turned into
the whole sequence's for this rank's heads. Then the chunks holding a blind query row, their outputs first (every key
a leaf: cache.BackwardCache). Then every chunk from the last: recomputed once with graph, its attention reading the K/V
buffers through a cache.JoinedCache, one `autograd.grad` taking its output's gradient and routing the K/V gradients
of earlier rows into their row-block sums (rows.py), whose block is final, and freed, at its first chunk's turn. A
mixer beside the attention (Falcon-H1) starts each chunk from its start states as leaves and hands their gradients
to the chunk before as those of its end states (recurrent.py). The module docstring of layer.py says why this is exact.
"""

import contextlib

import torch

from ..mst_core.grads import linear_weight_grads_summed, summed_as_computed
from ..mst_core.replay import restore_autocast_state, restore_rng_state
from ..mst_core.router_logits import positions
from ..mst_core.wrappers import check_graph_inputs
from . import recurrent
from .cache import BackwardCache, JoinedCache
from .offload import kept_input
from .rows import RowBlocks, row_blocks
from .wrappers import fp32_sums, parameter_grads


class LayerBackward:
    """The gradients of one streamed layer call, from the Function's `ctx` and the output's gradient."""

    def __init__(self, ctx, grad_out, grad_router_logits):
        self.ctx, self.grad_out, self.grad_router_logits = ctx, grad_out, grad_router_logits
        self.streamed = streamed = ctx.streamed
        self.x = kept_input(ctx)
        self.params = ctx.params
        self.needs_x = ctx.needs_input_grad[0]
        self.row_count = len(streamed.row_inputs)
        self.needs_rows = dict(zip(streamed.row_inputs, ctx.needs_input_grad[3 : 3 + self.row_count]))
        self.row_grads = {name: None for name, need in self.needs_rows.items() if need}  # full [B, S, ...] sums
        self.wanted = [p for p, need in zip(self.params, ctx.needs_input_grad[3 + self.row_count :]) if need]
        self.acc = [None] * len(self.wanted)  # each parameter's gradient, summed as autograd computes it
        self.grad_x = None  # RowBlocks of the input gradient, grown block by block as dK/dV blocks are freed
        self.checked = False  # the graph check (mst_core/wrappers.py), on the first recomputed chunk
        # A mixer beside the attention (Falcon-H1): the gradients of each chunk's start states, summed over its passes
        # (a blind chunk's output, then its turn), go to the chunk before as those of its end states.
        self.start_grads, self.end_grads = {}, {}
        # Set by `run`: the K/V buffers, their gradient sums by row block, the blocks.
        self.keys = self.values = self.grad_keys = self.grad_values = None
        self.blocks, self.block_starting_at = None, None

    def run(self):
        """(the input's gradient, None, None, the row inputs', the parameters'), as the Function's backward returns."""
        streamed = self.streamed
        # Each parameter gradient is added into `acc` as autograd computes it (the calls below get zeros of no storage).
        with (
            restore_autocast_state(self.ctx.autocast_state),
            summed_as_computed(self.acc, self.wanted, fp32_sums(streamed.layer, self.wanted)),
            streamed.views_of_one_mask(),
        ):
            self._keys_values()
            # Chunks holding a blind query row (they read keys after their own rows): their outputs first, every key
            # of their range a leaf.
            for index in sorted(streamed.blind):
                self._chunk_backward(index, self._leaves_cache(index), own_keys_values=False)
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
                if index in streamed.blind:
                    self._chunk_backward(index, self._leaves_cache(index, stop=True), outputs=False)
                else:
                    kv_start = streamed.key_ranges[index][0]
                    cache = JoinedCache(self.keys, self.values, start, end, kv_start, (self.grad_keys, self.grad_values))
                    self._chunk_backward(index, cache, own_keys_values=False)
                self._release_final_rows(index)
                streamed.recorded_projections.release(index)
                if streamed.states_mixer is not None and index > 0:  # the chunk before ends where this one starts
                    grads = self.start_grads.pop(index, [None, None])
                    if any(s is not None and g is None for s, g in zip(streamed.starts[index], grads)):
                        raise recurrent.missing_state_gradient(streamed.layer, start)
                    self.end_grads[index - 1] = grads
                    streamed.starts[index] = None  # read once more by no pass
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

    def _add_input_grads(self, grads, start, end):
        """Add the input gradients of rows [start, end) (grads: the layer input's if needs_x, the row inputs' in
        `row_grads`, *the parameters' zeros)."""
        for offset, name in enumerate(self.row_grads, start=int(self.needs_x)):
            if grads[offset] is not None:
                if self.row_grads[name] is None:
                    self.row_grads[name] = torch.zeros_like(self.streamed.row_inputs[name])
                self.row_grads[name][:, start:end] += grads[offset]
        if self.needs_x and grads[0] is not None:
            if self.grad_x is None:
                self.grad_x = RowBlocks(self.streamed.chunks, self.blocks, self.grad_out, dim=1, dtype=grads[0].dtype)
            self.grad_x.add(grads[0], start, end)

    def _add_start_grads(self, index, seam, grads):
        grads = iter(grads)
        got = [None if leaf is None else next(grads) for leaf in (seam.conv_state, seam.recurrent_state)]
        before = self.start_grads.get(index, [None, None])
        self.start_grads[index] = [b if g is None else g if b is None else b + g for g, b in zip(got, before)]

    def _chunk_backward(self, index, cache, outputs=True, own_keys_values=True):
        """Recompute chunk `index` with graph, its attention reading the K/V buffers through `cache`. `outputs`:
        backpropagate dOut of its rows (a JoinedCache routes the K/V gradients itself; a BackwardCache's leaves'
        gradients are added into dK/dV here); `own_keys_values` (a BackwardCache that stopped at the cache):
        backpropagate the (final) dK/dV of its own rows through the K/V the layer computed for them. A mixer beside the
        attention starts from its start states as leaves; at the chunk's turn (not a blind chunk's early output pass)
        its end states take their gradients too."""
        streamed, needs_x, wanted = self.streamed, self.needs_x, self.wanted
        start, end = streamed.chunks[index]
        seam, state_leaves, end_targets = None, [], []
        if streamed.states_mixer is not None:
            seam = recurrent.StateSeam(
                *(None if s is None else s.detach().requires_grad_() for s in streamed.starts[index])
            )
            state_leaves = [s for s in (seam.conv_state, seam.recurrent_state) if s is not None]
        kv_start, kv_end = streamed.key_ranges[index]
        # Its own K/V alone (no output): the state of the forward pass that wrote them.
        rng = streamed.chunk_rng[index] if outputs else streamed.keys_values_rng(index)
        # Half-precision linear weights: each chunk's gradient is one fp32-output GEMM into `acc` where the backend
        # has one (CUDA), not a half product added into the fp32 sum (mst_core/grads.py).
        linear_sums = linear_weight_grads_summed(self.acc, wanted, self.grad_out)
        with restore_rng_state(rng, self.grad_out.device), torch.enable_grad():
            x_chunk = self.x.rows(start, end).detach().requires_grad_(needs_x)
            rows = {name: value[:, start:end].detach().requires_grad_(self.needs_rows[name])
                    for name, value in streamed.row_inputs.items()}
            # The projections before the cache return what the K/V pass computed (projections.py), where this pass
            # replays that pass's RNG state: not a blind chunk's output, drawn in a pass of its own.
            replayed = contextlib.nullcontext()
            if rng is streamed.keys_values_rng(index):
                replayed = streamed.recorded_projections.replaying(index, linear_sums)
            with linear_sums or contextlib.nullcontext(), replayed:
                outs = streamed.call(x_chunk, index, cache, rows, seam) or ()
            inputs = [*([x_chunk] if needs_x else []), *(rows[name] for name in self.row_grads), *wanted]
            if seam is not None and (own_keys_values or index not in streamed.blind):
                # An end state without graph has nothing to backpropagate (recurrent.py's backward says why).
                end_grads = self.end_grads.pop(index, (None, None))
                end_targets = [(state, grad) for state, grad in zip(seam.end_states(), end_grads)
                               if grad is not None and state.requires_grad]
            if not self.checked:
                given = [x_chunk, *rows.values(), *(cache.leaves or []), *state_leaves, *self.params]
                for tensor in [*outs, cache.keys, cache.values]:
                    check_graph_inputs(tensor, given, "streaming backward")
                self.checked = True
            if outputs:
                leaves = cache.leaves
                # The chunk's output, and its router logits (router.py) with their rows of that gradient.
                grad_outs = [self.grad_out[:, start:end]]
                if len(outs) > 1:
                    logit_rows = positions(self.grad_router_logits.contiguous(), (streamed.batch,))[:, start:end]
                    grad_outs.append(logit_rows.reshape(outs[1].shape))
                grads = torch.autograd.grad(
                    [*outs, *(state for state, _ in end_targets)], [*leaves, *inputs, *state_leaves],
                    [*grad_outs, *(grad for _, grad in end_targets)], allow_unused=True,
                )
                del outs, grad_outs
                for total, part in zip((self.grad_keys, self.grad_values), grads[: len(leaves)]):
                    if part is not None:
                        total.add(part, kv_start, kv_end)
                self._add_input_grads(grads[len(leaves) : len(leaves) + len(inputs)], start, end)
                if seam is not None:
                    self._add_start_grads(index, seam, grads[len(leaves) + len(inputs) :])
                del grads
            if own_keys_values:
                pairs = [(tensor, total.rows(start, end, tensor.dtype))
                         for tensor, total in ((cache.keys, self.grad_keys), (cache.values, self.grad_values))
                         if tensor.requires_grad] + end_targets
                if pairs and (inputs or state_leaves):
                    grads = torch.autograd.grad(
                        [t for t, _ in pairs], [*inputs, *state_leaves], [g for _, g in pairs], allow_unused=True,
                    )
                    self._add_input_grads(grads[: len(inputs)], start, end)
                    if seam is not None:
                        self._add_start_grads(index, seam, grads[len(inputs) :])
            del cache, seam, end_targets

    def _gradients(self):
        streamed, ctx = self.streamed, self.ctx
        param_grads = parameter_grads(self.acc, self.wanted, streamed.layer, streamed.uncalled_parameters)
        grad_x = self.grad_x
        if self.needs_x and grad_x is not None:
            parts = [grad_x.pop(block) for block in range(len(grad_x.bounds))]
            if any(part is None for part in parts):  # every chunk's rows get an input gradient, if any does
                raise RuntimeError("streaming backward: the layer input got a gradient for some rows only.")
            grad_x = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
            del parts
            grad_x = grad_x.to(ctx.saved_input.dtype if ctx.saved_input is not None else grad_x.dtype)
        self.grad_x = None
        for name, total in self.row_grads.items():
            if total is None:
                raise RuntimeError(
                    f"streaming backward: {type(streamed.layer).__name__}'s argument {name!r} requires grad and got no "
                    "gradient from the recomputation; refusing to return a missing gradient."
                )
        all_grads = [next(param_grads) if need else None for need in ctx.needs_input_grad[3 + self.row_count :]]
        all_rows = [self.row_grads[name] if need else None for name, need in self.needs_rows.items()]
        return (grad_x, None, None, *all_rows, *all_grads)

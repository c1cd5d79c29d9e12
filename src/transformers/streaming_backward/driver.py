"""The chunk driver both streamed layers share: layer.py's, whose chunks meet the earlier tokens at the K/V cache
(cache.py), and recurrent.py's, whose chunks meet them at the recurrent state (states.py); Falcon-H1's layers at both.

Forward (no graph): `ChunkOutputs` fills the whole sequence's outputs chunk by chunk. Backward: chunk by chunk, each
recomputed once with graph from its rows (and its start states) as leaves, one `autograd.grad` taking the gradients
of its outputs (and of its end states, sent by the chunk after it) to its rows, the call's row inputs, the layer's
parameters (summed as computed: mst_core/grads.py) and its start states, which go on to the chunk before as those of
its end states (`ChunksBackward`). Which chunks run in which order, and what their cache holds, is the layer kind's:
backward.py's `LayerBackward` for attention, recurrent.py's `RecurrentBackward`.
"""

import contextlib

import torch

from ..mst_core.grads import linear_weight_grads_summed, summed_as_computed
from ..mst_core.replay import restore_autocast_state, restore_rng_state
from ..mst_core.router_logits import positions
from ..mst_core.wrappers import check_graph_inputs
from .offload import kept_input
from .rows import SOME_ROWS_ONLY, covers
from .states import StateSeam, missing_state_gradient
from .wrappers import fp32_sums, parameter_grads


class ChunkOutputs:
    """A chunked call's outputs over the whole sequence, written chunk by chunk: the layer's output [B, S, ...] and,
    where the model records them, its router logits [B * S, experts], token-major (router.py). Allocated at the
    first chunk: under autocast the output's dtype is not the input's."""

    def __init__(self, batch, seq_len):
        self.batch, self.seq_len = batch, seq_len
        self.out = self.logits = None

    def put(self, outs, start, end):
        """Chunk [start, end)'s outputs: (out,) or (out, router logits [B * chunk, experts])."""
        chunk_out, *chunk_logits = outs
        if self.out is None:
            self.out = chunk_out.new_empty((self.batch, self.seq_len) + chunk_out.shape[2:])
            if chunk_logits:
                self.logits = chunk_logits[0].new_empty((self.batch * self.seq_len,) + chunk_logits[0].shape[1:])
        self.out[:, start:end].copy_(chunk_out)
        if self.logits is not None:
            chunk_rows = chunk_logits[0].view(self.batch, end - start, -1)
            positions(self.logits, (self.batch,))[:, start:end].copy_(chunk_rows)

    def result(self):
        return (self.out,) if self.logits is None else (self.out, self.logits)


class WholeRows:
    """The layer input's gradient as one [B, S, ...] tensor, each chunk's rows written once (a recurrent layer's
    chunks read only their own rows); backward.py sums the attention layers' by row blocks instead (rows.RowBlocks)."""

    def __init__(self, like: torch.Tensor, dtype: torch.dtype):
        self.total = torch.empty_like(like, dtype=dtype)
        self.written = set()  # the row ranges [start, end) written

    def add(self, part, start, end):
        self.total[:, start:end].copy_(part)
        self.written.add((start, end))

    def whole(self):
        if not covers(self.written, 0, self.total.shape[1]):
            raise RuntimeError(SOME_ROWS_ONLY)
        total, self.total = self.total, None
        return total


class ChunksBackward:
    """The gradients of one streamed call, from its Function's `ctx` (the Function's inputs: x, the call, the
    input's storage, the call's row inputs, the layer's parameters) and its outputs' gradients. The call gives
    `chunks`, `row_inputs`, `layer`, `batch`, `uncalled_parameters`, `starts` (each chunk's start states, conv and
    recurrent, or None where the layer carries no state) and `call(x_chunk, index, cache, rows, seam)`. A subclass
    runs the chunks (`run`) through `_chunk_backward` and returns `_gradients()`."""

    def __init__(self, ctx, call, grad_out, grad_router_logits):
        self.ctx, self.call, self.grad_out, self.grad_router_logits = ctx, call, grad_out, grad_router_logits
        self.x = kept_input(ctx)
        self.params = ctx.params
        self.needs_x = ctx.needs_input_grad[0]
        self.row_count = len(call.row_inputs)
        self.needs_rows = dict(zip(call.row_inputs, ctx.needs_input_grad[3 : 3 + self.row_count]))
        self.row_grads = {name: None for name, need in self.needs_rows.items() if need}  # full [B, S, ...] sums
        self.wanted = [p for p, need in zip(self.params, ctx.needs_input_grad[3 + self.row_count :]) if need]
        self.acc = [None] * len(self.wanted)  # each parameter's gradient, summed as autograd computes it
        self.grad_x = None  # the input's gradient rows (`add`, `whole`), made at the first chunk that has one
        self.checked = False  # the graph check (mst_core/wrappers.py), on the first recomputed chunk
        # The gradients of each chunk's start states, summed over its passes (a blind chunk's output, then its turn),
        # go to the chunk before as those of its end states.
        self.start_grads, self.end_grads = {}, {}
        # The K/V buffers and their gradient sums (backward.py), for chunks whose cache has K/V leaves.
        self.grad_keys = self.grad_values = None

    @contextlib.contextmanager
    def summing(self):
        """The context of the whole backward: the forward's autocast state, and each parameter gradient added into
        `acc` as autograd computes it (the `autograd.grad` calls get zeros of no storage)."""
        sums_in_fp32 = fp32_sums(self.call.layer, self.wanted)
        with restore_autocast_state(self.ctx.autocast_state), summed_as_computed(self.acc, self.wanted, sums_in_fp32):
            yield

    def input_rows(self, like: torch.Tensor, dtype: torch.dtype):
        """The input gradient's rows (`WholeRows` here; row blocks for attention layers)."""
        return WholeRows(like, dtype)

    def replaying(self, index, rng, linear_sums):
        """A context under which chunk `index`'s projections before the cache replay what the K/V pass recorded
        (backward.py); none here."""
        return contextlib.nullcontext()

    def pass_states_back(self, index):
        """At chunk `index`'s end: its start states' gradients become the chunk before's end states' (refusing a
        state that took none), and its start states are read by no later pass."""
        start = self.call.chunks[index][0]
        grads = self.start_grads.pop(index, [None, None])
        if any(s is not None and g is None for s, g in zip(self.call.starts[index], grads)):
            raise missing_state_gradient(self.call.layer, start)
        self.end_grads[index - 1] = grads
        self.call.starts[index] = None

    def _add_input_grads(self, grads, start, end):
        """Add the input gradients of rows [start, end) (grads: the layer input's if needs_x, the row inputs' in
        `row_grads`, *the parameters' zeros)."""
        for offset, name in enumerate(self.row_grads, start=int(self.needs_x)):
            if grads[offset] is not None:
                if self.row_grads[name] is None:
                    self.row_grads[name] = torch.zeros_like(self.call.row_inputs[name])
                self.row_grads[name][:, start:end] += grads[offset]
        if self.needs_x and grads[0] is not None:
            if self.grad_x is None:
                self.grad_x = self.input_rows(self.grad_out, grads[0].dtype)
            self.grad_x.add(grads[0], start, end)

    def _add_start_grads(self, index, seam, grads):
        grads = iter(grads)
        got = [None if leaf is None else next(grads) for leaf in (seam.conv_state, seam.recurrent_state)]
        before = self.start_grads.get(index, [None, None])
        self.start_grads[index] = [b if g is None else g if b is None else b + g for g, b in zip(got, before)]

    def _chunk_backward(self, index, cache, rng, outputs=True, own_keys_values=False, end_states=True):
        """Recompute chunk `index` with graph under the RNG state `rng`, its attention (if any) meeting `cache`.
        `outputs`: backpropagate dOut of its rows (a JoinedCache routes the K/V gradients itself; a BackwardCache's
        leaves' gradients are added into dK/dV here); `own_keys_values` (a BackwardCache that stopped at the cache):
        backpropagate the (final) dK/dV of its own rows through the K/V the layer computed for them. A layer carrying
        states starts from its start states as leaves; with `end_states` (not a blind chunk's early output pass) its
        end states take the gradients the chunk after sent them."""
        call, needs_x, wanted = self.call, self.needs_x, self.wanted
        start, end = call.chunks[index]
        seam, state_leaves, end_targets = None, [], []
        if call.starts is not None:
            seam = StateSeam(*(None if s is None else s.detach().requires_grad_() for s in call.starts[index]))
            state_leaves = [s for s in (seam.conv_state, seam.recurrent_state) if s is not None]
        # Half-precision linear weights: each chunk's gradient is one fp32-output GEMM into `acc` where the backend
        # has one (CUDA), not a half product added into the fp32 sum (mst_core/grads.py).
        linear_sums = linear_weight_grads_summed(self.acc, wanted, self.grad_out)
        with restore_rng_state(rng, self.grad_out.device), torch.enable_grad():
            x_chunk = self.x.rows(start, end).detach().requires_grad_(needs_x)
            rows = {name: value[:, start:end].detach().requires_grad_(self.needs_rows[name])
                    for name, value in call.row_inputs.items()}
            with linear_sums or contextlib.nullcontext(), self.replaying(index, rng, linear_sums):
                outs = call.call(x_chunk, index, cache, rows, seam) or ()
            inputs = [*([x_chunk] if needs_x else []), *(rows[name] for name in self.row_grads), *wanted]
            if seam is not None and end_states:
                # An end state without graph depends on nothing that takes a gradient here (a conv state of frozen
                # projections' outputs, with adapters only after the conv): nothing to backpropagate.
                end_grads = self.end_grads.pop(index, (None, None))
                end_targets = [(state, grad) for state, grad in zip(seam.end_states(), end_grads)
                               if grad is not None and state.requires_grad]
            leaves = [] if cache is None else cache.leaves or []
            if not self.checked:
                given = [x_chunk, *rows.values(), *leaves, *state_leaves, *self.params]
                for tensor in [*outs, *([] if cache is None else [cache.keys, cache.values])]:
                    check_graph_inputs(tensor, given, "streaming backward")
                self.checked = True
            if outputs:
                # The chunk's output, and its router logits (router.py) with their rows of that gradient.
                grad_outs = [self.grad_out[:, start:end]]
                if len(outs) > 1:
                    if self.grad_router_logits is None:  # nothing downstream read the router logits
                        outs = outs[:1]
                    else:
                        logit_rows = positions(self.grad_router_logits.contiguous(), (call.batch,))[:, start:end]
                        grad_outs.append(logit_rows.reshape(outs[1].shape))
                grads = torch.autograd.grad(
                    [*outs, *(state for state, _ in end_targets)], [*leaves, *inputs, *state_leaves],
                    [*grad_outs, *(grad for _, grad in end_targets)], allow_unused=True,
                )
                del outs, grad_outs
                if leaves:
                    kv_start, kv_end = call.key_ranges[index]
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
        """(the input's gradient, None, None, the row inputs', the parameters'), as the Function's backward returns."""
        call, ctx = self.call, self.ctx
        param_grads = parameter_grads(self.acc, self.wanted, call.layer, call.uncalled_parameters)
        grad_x = None
        if self.needs_x:  # every row of the input gets a gradient (else SOME_ROWS_ONLY), or none does: refused
            if self.grad_x is None:
                raise RuntimeError(
                    f"streaming backward: {type(call.layer).__name__}'s input got no gradient from the recomputation; "
                    "refusing to return a missing gradient."
                )
            grad_x = self.grad_x.whole()
            grad_x = grad_x.to(ctx.saved_input.dtype if ctx.saved_input is not None else grad_x.dtype)
        self.grad_x = None
        all_grads = [next(param_grads) if need else None for need in ctx.needs_input_grad[3 + self.row_count :]]
        all_rows = [self.row_grads[name] if need else None for name, need in self.needs_rows.items()]
        return (grad_x, None, None, *all_rows, *all_grads)

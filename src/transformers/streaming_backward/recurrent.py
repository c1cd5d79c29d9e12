"""A recurrent decoder layer (a state-space or linear-attention mixer: Mamba2's) streamed chunk by chunk through its
state: the adjoint method of adjoint sharding (Xu et al., TMLR, https://openreview.net/forum?id=kQCuMcEneq, §4) at
chunk granularity, run by the layer's own forward.

Upstream's recurrent layers already run chunked prefill through their cache: the mixer reads the state at the chunk's
start (`cache.get_conv_state` / `cache.get_recurrent_state`), hands it to its own convolution and scan, and returns
the end state (`update_conv_state`, which also returns the earlier inputs joined to the chunk's, and
`update_recurrent_state`). `StateSeam` is a cache of ours at that seam, for one chunk.

Forward (no graph): chunk by chunk, each chunk's layer forward from the previous chunk's end states; only the layer
input and each chunk's start states are kept (`[B, conv_dim, kernel]` and the scan's state, e.g. `[B, H, P, N]`: small
next to the input's `[B, S, d]`). Backward, from the last chunk: chunk i is recomputed once with graph from its start
states as leaves, and one `autograd.grad` takes its output's gradient and the gradients arriving at its end states (from
chunk i + 1) to the layer input's rows, the parameters and the start states, whose gradients go on to chunk i - 1. The
recurrence is linear in its state, so this is exact: each token goes through the layer twice a step, as under
checkpointing, and the backward holds one chunk's activations.

Where a wrapper may swap the weights (ZeRO-3, FSDP1, accelerate hooks: wrappers.py), each chunk is an ordinary
checkpoint instead, its start states among its inputs: autograd delivers every gradient the wrapper expects.

A hybrid's block that mixes no tokens (Nemotron-H's MLP and MoE blocks: parts.positionwise_mixer) streams the same
way with no state at all: each chunk depends on its own rows only. Unstreamed, such a block would keep its whole
activations for the backward where streaming replaces checkpointing.
"""

import contextlib

import torch

from ..mst_core.chunks import carrying_states, one_streamed_chunk, policy_device_type
from ..mst_core.fields import STREAMING_FIELD
from ..mst_core.grads import linear_weight_grads_summed, summed_as_computed
from ..mst_core.replay import capture_autocast_state, capture_rng_state, restore_autocast_state, restore_rng_state
from ..mst_core.router_logits import positions, token_major
from ..mst_core.wrappers import check_graph_inputs, refuse_create_graph
from . import router
from .checks import check_captured_outputs
from .config import streaming_chunk_size
from .offload import input_storage, keep_input, kept_input, saved_tensors_offloaded
from .parts import layer_config, positionwise_mixer, recurrent_mixer
from .rows import row_inputs, slice_rows
from .wrappers import fp32_sums, layer_parameters, noting_uncalled_parameters, parameter_grads


# A packed batch's sequence boundaries, as a recurrent mixer's kernel reads them (Qwen3-Next's Gated DeltaNet passes
# `cu_seq_lens_q` to flash-linear-attention's scan as `cu_seqlens`): refused (RecurrentCall).
PACKED_SEQUENCE_ARGUMENTS = ("cu_seq_lens_q", "cu_seq_lens_k", "seq_idx")


class StateSeam:
    """The cache a recurrent layer's own forward meets on one chunk: the states at the chunk's start (None at the
    sequence's start), and the end states the layer hands back (`end_states`)."""

    def __init__(self, conv_state=None, recurrent_state=None):
        self.conv_state, self.recurrent_state = conv_state, recurrent_state
        self.conv_end = self.recurrent_end = None
        self.met = False  # whether the layer read its state here (else it is not a layer this seam streams)

    def get_conv_state(self, layer_idx, state_idx=0):
        self.met = True
        return self.conv_state

    def get_recurrent_state(self, layer_idx, state_idx=0):
        self.met = True
        return self.recurrent_state

    def is_recording_past(self, layer_idx):
        # True: a one-token chunk then joins its input to the conv state through `update_conv_state`, as longer
        # chunks do, instead of the decode kernel that updates the conv state in place.
        return True

    def update_conv_state(self, conv_states, layer_idx, state_idx=0, conv_kernel_size=None, **kwargs):
        """The chunk's conv inputs [B, C, T] joined after the start state's, as upstream's cache returns them (a
        sequence's first chunk shorter than the kernel padded with zeros on the left); the last `conv_kernel_size`
        columns are the end state."""
        joined = conv_states if self.conv_state is None else torch.cat([self.conv_state, conv_states], dim=-1)
        if joined.shape[-1] < conv_kernel_size:
            joined = torch.nn.functional.pad(joined, (conv_kernel_size - joined.shape[-1], 0))
        self.conv_end = joined[..., -conv_kernel_size:]
        return joined

    def update_recurrent_state(self, recurrent_states, layer_idx, state_idx=0, **kwargs):
        self.recurrent_end = recurrent_states
        return recurrent_states

    def end_states(self):
        """(conv state, recurrent state) at the chunk's end, as the next chunk starts from them."""
        return self.conv_end, self.recurrent_end


class StatesBesideKeysValues:
    """The cache of one chunk of a layer whose attention and recurrent mixer both meet it in one forward (Falcon-H1):
    the attention's `update` goes to the chunk's K/V cache (cache.py), the mixer's state calls to its `StateSeam`."""

    def __init__(self, keys_values, seam):
        self.update, self.get_seq_length = keys_values.update, keys_values.get_seq_length
        for name in ("get_conv_state", "get_recurrent_state", "is_recording_past", "update_conv_state",
                     "update_recurrent_state"):
            setattr(self, name, getattr(seam, name))


def state_chunks(seq_len, chunk):
    """[(start, end)] of chunks of `chunk` tokens for a layer carrying a state. No one-token chunk after the first:
    with a state, the mixer takes its one-token decode step, which updates the state in place after reading it for
    the output (Mamba2's `mamba2_selective_state_update`), so autograd cannot backpropagate it. Chunks of 1 are taken
    as 2, a last chunk of 1 joins the one before."""
    chunk = max(chunk, 2)
    chunks = [(start, min(start + chunk, seq_len)) for start in range(0, seq_len, chunk)]
    if len(chunks) > 1 and chunks[-1][1] - chunks[-1][0] == 1:
        chunks[-2:] = [(chunks[-2][0], seq_len)]
    return chunks


def refuse_packed_sequences(layer, arguments):
    packed = [name for name in PACKED_SEQUENCE_ARGUMENTS if arguments.get(name) is not None]
    if packed:
        raise ValueError(
            f"{STREAMING_FIELD}: {type(layer).__name__} got packed sequences (`{packed[0]}`), which a streamed "
            "recurrent layer does not take yet: each chunk's scan would read the whole sequence's boundaries. "
            "Pad the sequences instead of packing them, or unset the field."
        )


def missing_state_gradient(layer, start):
    """The error of a chunk whose start state got no gradient."""
    # The chunk's output depends on the state it started from; a scan (a fused kernel) that takes the state without
    # its gradient would silently cut the sequence's gradient at the boundary.
    return RuntimeError(
        f"streaming backward: {type(layer).__name__}'s chunk from token {start} returned no gradient for the state it "
        "started from (its scan or convolution took the carried state without a gradient path); refusing to drop it. "
        f"Unset {STREAMING_FIELD}, or run the mixer's PyTorch path (uninstall the kernel package it uses)."
    )


class RecurrentCall:
    """One call of a recurrent decoder layer, split into chunks of tokens."""

    def __init__(self, forward, layer, arguments, cache_name, hidden_states, records_router_logits=False):
        self.forward, self.layer, self.cache_name, self.arguments = forward, layer, cache_name, arguments
        self.records_router_logits = records_router_logits  # an MoE block's router logits (router.py)
        self.batch, self.seq_len = hidden_states.shape[:2]
        refuse_packed_sequences(layer, arguments)
        config = layer_config(layer)
        chunk = streaming_chunk_size(getattr(config, STREAMING_FIELD), config.hidden_size,
                                     policy_device_type(hidden_states))
        self.chunks = state_chunks(self.seq_len, chunk)
        self.row_inputs = row_inputs(arguments, self.batch, self.seq_len)
        self.stateless = recurrent_mixer(layer) is None  # a block that mixes no tokens: it meets no state
        self.uncalled_parameters = set()  # ids (wrappers.noting_uncalled_parameters)

    def call(self, x_chunk, index, seam, rows=None):
        """The layer's own forward on chunk `index`, its mixer meeting `seam` (`rows`: the chunk's rows of
        `row_inputs` to use instead of slices of them): (the chunk's output, its router logits [batch * rows, experts]
        or None)."""
        start, end = self.chunks[index]
        kwargs = {name: slice_rows(value, start, end, self.seq_len) for name, value in self.arguments.items()}
        kwargs.update(rows or {})
        kwargs[self.cache_name] = seam
        with one_streamed_chunk(), carrying_states(seam), router.chunk_collector(self.records_router_logits) as collected:
            out = self.forward(self.layer, x_chunk, **kwargs)
        if not seam.met and not self.stateless:
            raise ValueError(
                f"{STREAMING_FIELD}: {type(self.layer).__name__} cannot be streamed: its mixer never read its state "
                "from the cache (`get_conv_state` / `get_recurrent_state`). Unset the field for this model."
            )
        if isinstance(out, tuple):  # Bamba's (hidden states, attention weights): parts.returned gives it back
            out = out[0]
        return out, router.chunk_logits(collected, self.layer, self.batch, end - start)


class StreamedRecurrentFunction(torch.autograd.Function):
    """Inputs: x [B, S, d], the `RecurrentCall`, whether to keep x in host memory (offload.py: a storage, or None),
    the call's `row_inputs` (their order), the layer's parameters that require grad (plain leaf parameters:
    wrappers.py). Saves x and each chunk's start states (the row inputs are held by the call's arguments). Outputs the
    layer's output, and its router logits over the whole sequence where the model records them (router.py)."""

    @staticmethod
    def forward(ctx, x, call, storage, *tensors):
        ctx.call, ctx.params = call, tensors[len(call.row_inputs) :]
        keep_input(ctx, x, storage)
        ctx.autocast_state = capture_autocast_state(x.device.type)
        ctx.rng, ctx.starts = [], [(None, None)]
        out, logits = None, []
        with noting_uncalled_parameters(call.layer, call.uncalled_parameters):
            for index, (start, end) in enumerate(call.chunks):
                ctx.rng.append(capture_rng_state(x.device))  # dropout draws the same masks when the chunk is recomputed
                seam = StateSeam(*ctx.starts[-1])
                chunk_out, chunk_logits = call.call(x[:, start:end], index, seam)
                if out is None:
                    out = chunk_out.new_empty(x.shape[:2] + chunk_out.shape[2:])
                out[:, start:end].copy_(chunk_out)
                if chunk_logits is not None:
                    logits.append(chunk_logits)
                # copies: the conv state is a view of the chunk's joined inputs
                ctx.starts.append(tuple(None if s is None else s.clone() for s in seam.end_states()))
                del chunk_out, seam
        ctx.starts.pop()  # the last chunk's end state: nothing reads it
        return (out, token_major(logits, (call.batch,))) if logits else out

    @staticmethod
    def backward(ctx, grad_out, grad_router_logits=None):
        refuse_create_graph("streaming backward", STREAMING_FIELD)
        x = kept_input(ctx)
        call, params = ctx.call, ctx.params
        needs_x = ctx.needs_input_grad[0]
        row_count = len(call.row_inputs)
        needs_rows = dict(zip(call.row_inputs, ctx.needs_input_grad[3 : 3 + row_count]))
        wanted = [p for p, need in zip(params, ctx.needs_input_grad[3 + row_count :]) if need]
        acc = [None] * len(wanted)
        # a decoder layer's output has its input's shape
        grad_x = torch.empty_like(grad_out, dtype=x.dtype) if needs_x else None
        # Each row input's gradient, made at the first chunk whose recompute reads it; None where none does (Zamba2's
        # Mamba2 layers are passed the embeddings and never read them), as autograd gives an unused input none.
        row_grads = dict.fromkeys(name for name, need in needs_rows.items() if need)
        end_grads = (None, None)  # the gradients arriving at the current chunk's end states
        checked = False
        # Each parameter gradient is added into `acc` as autograd computes it (mst_core/grads.py).
        with restore_autocast_state(ctx.autocast_state), summed_as_computed(acc, wanted, fp32_sums(call.layer, wanted)):
            for index in reversed(range(len(call.chunks))):
                start, end = call.chunks[index]
                leaves = [None if s is None else s.detach().requires_grad_() for s in ctx.starts[index]]
                ctx.starts[index] = None  # read once
                linear_sums = linear_weight_grads_summed(acc, wanted, grad_out)
                with restore_rng_state(ctx.rng[index], grad_out.device), torch.enable_grad():
                    x_chunk = x.rows(start, end).detach().requires_grad_(needs_x)
                    rows = {name: value[:, start:end].detach().requires_grad_(needs_rows[name])
                            for name, value in call.row_inputs.items()}
                    seam = StateSeam(*leaves)
                    with linear_sums or contextlib.nullcontext():
                        out, logits = call.call(x_chunk, index, seam, rows)
                    outputs, seeds = [out], [grad_out[:, start:end]]
                    if logits is not None and grad_router_logits is not None:
                        outputs.append(logits)
                        logit_rows = positions(grad_router_logits.contiguous(), (call.batch,))[:, start:end]
                        seeds.append(logit_rows.reshape(logits.shape))
                    for state, grad in zip(seam.end_states(), end_grads):
                        # An end state without graph depends on nothing that takes a gradient here (a conv state of
                        # frozen projections' outputs, with adapters only after the conv): nothing to backpropagate.
                        if grad is not None and state.requires_grad:
                            outputs.append(state)
                            seeds.append(grad)
                    state_leaves = [leaf for leaf in leaves if leaf is not None]
                    row_leaves = [rows[name] for name in row_grads]
                    inputs = [*([x_chunk] if needs_x else []), *row_leaves, *state_leaves, *wanted]
                    if not checked:
                        for tensor in outputs:
                            check_graph_inputs(tensor, [x_chunk, *rows.values(), *state_leaves, *params],
                                               "streaming backward")
                        checked = True
                    grads = list(torch.autograd.grad(outputs, inputs, seeds, allow_unused=True))
                    del outputs, seeds, out, logits, seam, rows, row_leaves
                if needs_x:
                    part = grads.pop(0)
                    if part is None:
                        raise RuntimeError(
                            f"streaming backward: {type(call.layer).__name__}'s input rows {start}:{end} got no "
                            "gradient from the recomputation; refusing to return a missing gradient."
                        )
                    grad_x[:, start:end].copy_(part)
                for name in row_grads:
                    part = grads.pop(0)
                    if part is not None:
                        if row_grads[name] is None:
                            row_grads[name] = torch.zeros_like(call.row_inputs[name])
                        row_grads[name][:, start:end].copy_(part)
                state_grads = iter(grads[: len(state_leaves)])
                end_grads = tuple(None if leaf is None else next(state_grads) for leaf in leaves)
                if any(leaf is not None and grad is None for leaf, grad in zip(leaves, end_grads)):
                    raise missing_state_gradient(call.layer, start)
                del grads
        param_grads = parameter_grads(acc, wanted, call.layer, call.uncalled_parameters)
        all_rows = [row_grads.get(name) for name in call.row_inputs]
        all_params = [next(param_grads) if need else None for need in ctx.needs_input_grad[3 + row_count :]]
        return (grad_x, None, None, *all_rows, *all_params)


def _forward_with_checkpoints(call, x):
    """Autograd fallback where a wrapper may swap the layer's weights: each chunk an ordinary (non-reentrant)
    checkpoint from its start states, which are among its inputs."""
    from torch.utils.checkpoint import checkpoint

    def chunk(x_chunk, conv_state, recurrent_state, index):
        seam = StateSeam(conv_state, recurrent_state)
        out, logits = call.call(x_chunk, index, seam)
        return out, logits, *seam.end_states()

    outs, logits, states = [], [], (None, None)
    for index, (start, end) in enumerate(call.chunks):
        out, chunk_logits, *states = checkpoint(chunk, x[:, start:end], *states, index, use_reentrant=False)
        outs.append(out)
        if chunk_logits is not None:
            logits.append(chunk_logits)
    out = torch.cat(outs, dim=1)
    return (out, token_major(logits, (call.batch,))) if logits else out


def prepared_call(forward, layer, hidden_states, arguments, cache_name):
    """The `RecurrentCall` of this call (`arguments`: by name, without the hidden states and the cache), after the
    checks of a streamed call."""
    collector = router.model_collector()
    check_captured_outputs(layer, collector)
    return RecurrentCall(forward, layer, arguments, cache_name, hidden_states, router.recording(collector))


def streamed_outputs(call, layer, hidden_states):
    """The layer's output, or (output, router logits), by the Function or the wrappers' fallback."""
    params = layer_parameters(layer, mixer=recurrent_mixer(layer) or positionwise_mixer(layer))
    storage = input_storage(layer)
    if params is None:
        with saved_tensors_offloaded(storage, hidden_states.device):
            return _forward_with_checkpoints(call, hidden_states)
    # Nothing requiring grad (a frozen layer): autograd records no node, and the context's states go with the call.
    return StreamedRecurrentFunction.apply(hidden_states, call, storage, *call.row_inputs.values(), *params)


def check_cache_has_no_state(layer, cache) -> None:
    """A streamed recurrent layer neither reads nor fills the cache (as checks.py's `check_cache_is_empty` for
    attention): a training forward with `use_cache=True` returns the model's empty cache; a state carried in from an
    earlier call would be silently not continued: refused."""
    layer_idx = getattr(recurrent_mixer(layer), "layer_idx", None)
    if cache is None or layer_idx is None:
        return
    if cache.get_conv_state(layer_idx) is not None or cache.get_recurrent_state(layer_idx) is not None:
        raise ValueError(
            f"{STREAMING_FIELD}: the cache passed (`cache`) holds layer {layer_idx}'s state from an earlier call, "
            "which a streamed layer cannot continue from (streamed training forwards neither read nor fill a cache). "
            "Train without a cache, or unset the field."
        )

"""A recurrent decoder layer (a state-space or linear-attention mixer: Mamba2's) streamed chunk by chunk through its
state: the adjoint method of adjoint sharding (Xu et al., TMLR, https://openreview.net/forum?id=kQCuMcEneq, §4) at
chunk granularity, run by the layer's own forward, meeting the state at upstream's cache seam (states.py).

Forward (no graph): chunk by chunk, each chunk's layer forward from the previous chunk's end states; only the layer
input and each chunk's start states are kept (`[B, conv_dim, kernel]` and the scan's state, e.g. `[B, H, P, N]`: small
next to the input's `[B, S, d]`). Backward, from the last chunk (the chunk driver, driver.py): chunk i is recomputed
once with graph from its start states as leaves, and one `autograd.grad` takes its output's gradient and the gradients
arriving at its end states (from chunk i + 1) to the layer input's rows, the parameters and the start states, whose
gradients go on to chunk i - 1. The recurrence is linear in its state, so this is exact: each token goes through the
layer twice a step, as under checkpointing, and the backward holds one chunk's activations.

Where a wrapper may swap the weights (ZeRO-3, FSDP1, accelerate hooks: wrappers.py), each chunk is an ordinary
checkpoint instead, its start states among its inputs: autograd delivers every gradient the wrapper expects.

A hybrid's block that mixes no tokens (Nemotron-H's MLP and MoE blocks: parts.positionwise_mixer) streams the same
way with no state at all: each chunk depends on its own rows only. Unstreamed, such a block would keep its whole
activations for the backward where streaming replaces checkpointing.
"""

import torch

from ..mst_core.chunks import carrying_states, one_streamed_chunk, policy_device_type
from ..mst_core.fields import STREAMING_FIELD
from ..mst_core.replay import capture_autocast_state, capture_rng_state
from ..mst_core.router_logits import token_major
from ..mst_core.wrappers import refuse_create_graph
from . import router
from .checks import check_captured_outputs
from .config import streaming_chunk_size
from .driver import ChunkOutputs, ChunksBackward
from .offload import input_storage, keep_input, saved_tensors_offloaded
from .parts import layer_config, positionwise_mixer, recurrent_mixer
from .rows import row_inputs, slice_rows
from .states import StateSeam, refuse_packed_sequences, state_chunks
from .wrappers import layer_parameters, noting_uncalled_parameters


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
        # The states at each chunk's start (conv, recurrent) and the RNG state of its forward, recorded by the
        # Function's forward, read (and dropped) by its backward (driver.py).
        self.starts, self.chunk_rng = [(None, None)], []

    def call(self, x_chunk, index, cache=None, rows=None, seam=None):
        """The layer's own forward on chunk `index`, its mixer meeting `seam` (states.StateSeam; `rows`: the chunk's
        rows of `row_inputs` to use instead of slices of them): (its output,) or (its output, its router logits
        [batch * rows, experts]), as layer.py's `StreamedCall.call` (whose `cache`, the K/V seam, a recurrent layer
        has none of)."""
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
        logits = router.chunk_logits(collected, self.layer, self.batch, end - start)
        return (out,) if logits is None else (out, logits)


class StreamedRecurrentFunction(torch.autograd.Function):
    """Inputs: x [B, S, d], the `RecurrentCall`, whether to keep x in host memory (offload.py: a storage, or None),
    the call's `row_inputs` (their order), the layer's parameters that require grad (plain leaf parameters:
    wrappers.py). Saves x; the call keeps each chunk's start states (the row inputs are held by the call's
    arguments). Outputs the layer's output, and its router logits over the whole sequence where the model records
    them (router.py)."""

    @staticmethod
    def forward(ctx, x, call, storage, *tensors):
        ctx.call, ctx.params = call, tensors[len(call.row_inputs) :]
        keep_input(ctx, x, storage)
        ctx.autocast_state = capture_autocast_state(x.device.type)
        call.starts, call.chunk_rng = [(None, None)], []
        outputs = ChunkOutputs(call.batch, call.seq_len)
        with noting_uncalled_parameters(call.layer, call.uncalled_parameters):
            for index, (start, end) in enumerate(call.chunks):
                call.chunk_rng.append(capture_rng_state(x.device))  # dropout draws the same masks in the recompute
                seam = StateSeam(*call.starts[-1])
                outputs.put(call.call(x[:, start:end], index, seam=seam), start, end)
                # copies: the conv state is a view of the chunk's joined inputs
                call.starts.append(tuple(None if s is None else s.clone() for s in seam.end_states()))
                del seam
        call.starts.pop()  # the last chunk's end state: nothing reads it
        result = outputs.result()
        return result if len(result) > 1 else result[0]

    @staticmethod
    def backward(ctx, grad_out, grad_router_logits=None):
        refuse_create_graph("streaming backward", STREAMING_FIELD)
        return RecurrentBackward(ctx, ctx.call, grad_out, grad_router_logits).run()


class RecurrentBackward(ChunksBackward):
    """The chunks from the last to the first, each from its start states (the driver's turn of one chunk)."""

    def run(self):
        with self.summing():
            for index in reversed(range(len(self.call.chunks))):
                self._chunk_backward(index, None, self.call.chunk_rng[index])
                if index > 0:
                    self.pass_states_back(index)
        return self._gradients()


def _forward_with_checkpoints(call, x):
    """Autograd fallback where a wrapper may swap the layer's weights: each chunk an ordinary (non-reentrant)
    checkpoint from its start states, which are among its inputs."""
    from torch.utils.checkpoint import checkpoint

    def chunk(x_chunk, conv_state, recurrent_state, index):
        seam = StateSeam(conv_state, recurrent_state)
        outs = call.call(x_chunk, index, seam=seam)
        return outs[0], outs[1] if len(outs) > 1 else None, *seam.end_states()

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

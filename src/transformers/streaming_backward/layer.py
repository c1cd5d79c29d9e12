"""A decoder layer's own forward, streamed query chunk by query chunk (StreamBP, arXiv 2506.03077 §3.2.2, Fig. 2).

Nothing of a family's arithmetic is re-spelled here: each chunk runs the layer class's `forward` (upstream's code)
on x[:, start:end] with the exact slice of the mask and of the position embeddings, and a cache object of ours
(cache.py) where its attention calls `cache.update(k, v, ...)`: the one place a chunk's keys/values meet the
earlier tokens'. So any family whose attention uses that seam streams (q/k norms, fused qkv, sandwich norms, MoE
blocks, ...), and a rebase sees upstream's layer changes.

Forward (no graph): chunk by chunk, the recording cache writes the chunk's K/V (after K-norm and RoPE, before
repeat_kv) into full-sequence buffers and returns K/V[kv_start:kv_end]. Only the layer input is saved for backward
(as checkpointing saves it).

Backward (one autograd Function; its steps in backward.py). First every chunk's K/V again, without graph (the layer stopped at the cache: the
K/V pass). It skips q_proj where nothing in it draws random numbers (cache.queries_not_computed) and records the
outputs of the projections before the cache (k_proj, v_proj, a fused qkv_proj: projections.py). Then the chunks from
the last to the first. Chunk i is recomputed once, with graph, with a cache (cache.JoinedCache) that returns the
buffers' K/V[kv_start:end] (views, no copy) joined to the K/V the layer computes for the chunk's own rows. One
`autograd.grad` of out_i then does everything: at the join, the gradient of the earlier rows is added into dK/dV (row
blocks, rows.py), and that of the chunk's own rows, plus what later chunks summed there (final: earlier chunks read
no key after their own start), flows on through the layer's own K/V projections (which hand back their recorded
outputs), norms and RoPE. So every projection sees each token twice per step, as under checkpointing (q_proj, o_proj,
the MLP: forward and recompute; k/v: forward and K/V pass), and chunk i reads only keys before its end.

A chunk holding a query row that sees no key (a left-padding position) or a key after the chunk's end (a
bidirectional block: Gemma-3's image tokens, a prefix-LM mask) reads the whole sequence with its full mask rows, as
the unsplit layer does (a blind chunk, masks.plan_key_ranges): in the forward it first only records its K/V (the
layer stops at the cache, `StopAfterKeysValues`) and runs once every key exists; in the backward its output is backpropagated first
(every key a leaf), its own K/V at its turn (the layer stopped at the cache again). Only such chunks cost more passes
through the projections before the cache (a K/V-only pass in the forward; their output recompute replays another RNG
state than the backward's K/V pass, so it computes them again instead of reading their records).

MoE router logits (`output_router_logits=True`) come back whole, with their graph, as one more output (router.py).

A layer with a recurrent mixer beside its attention (Falcon-H1's; Zamba2's hybrid layers, whose shared attention block
runs before the mixer) streams here too, its cache object for a chunk both seams (states.py `StatesBesideKeysValues`):
the forward keeps each chunk's start states, and each chunk's turn in the backward starts from them as leaves and
takes the gradients the next chunk sent to its end states, as a recurrent layer does (recurrent.py; both chunk
loops' backward turns are the chunk driver's, driver.py).
"""

import contextlib
import inspect

import torch

from ..mst_core.chunks import inside_streamed_chunk, one_streamed_chunk, policy_device_type
from ..mst_core.families import streaming_model_types, streaming_refusal
from ..mst_core.fields import STREAMING_FIELD
from ..mst_core.host_mask import HostMask, built_masks
from ..mst_core.replay import capture_autocast_state, capture_rng_state, restore_rng_state
from ..mst_core.router_logits import token_major
from ..mst_core.sharded_sequence import ShardedSequenceMask
from ..mst_core.wrappers import refuse_create_graph, saved_once
from .cache import (
    FixedCache,
    RecordingCache,
    StopAfterKeysValues,
    discardable_query_projection,
    queries_not_computed,
)
from .checks import (
    FLASH_ATTENTION,
    check_attention_call,
    check_cache_is_empty,
    check_captured_outputs,
)
from . import parts, recurrent, router
from .backward import LayerBackward
from .config import streaming_chunk_size
from .driver import ChunkOutputs
from .masks import (
    FLASH_VARLEN_KWARGS,
    OffsetChunkMasks,
    chunk_mask,
    flash_chunk_mask,
    lower_right_causal_bias,
    packed_sequence_starts,
    plan_flash_chunks,
    plan_key_ranges,
    sliding_window,
    splits_on_cpu,
)
from .offload import input_storage, keep_input, saved_tensors_offloaded
from .projections import RecordedProjections, recordable_projections
from .rows import row_inputs, slice_rows
from .states import StateSeam, StatesBesideKeysValues, refuse_packed_sequences, state_chunks
from .wrappers import layer_parameters, noting_uncalled_parameters
from .zero3_leaves import leaf_gradients_queued_once


STREAMING_MODEL_TYPES = streaming_model_types()


def applies(layer) -> bool:
    """Whether `layer`'s forward should stream (GradientCheckpointingLayer asks, patch 0008): the field is set, the
    layer trains with grad enabled, and its model type is one the registry streams (mst_core/families.py), its config
    not one the registry excepts (`streaming_unless`: Gemma-4's K/V shared across layers).
    A layer of another family (the field set on it by `from_pretrained` or a config.json) is not streamed: the
    model warned at construction that the field is ignored (mst_core/model_checks.py)."""
    if parts.inside_a_layer(layer):  # inside a streamed chunk of the layer around it: as it is (decoder_layer_forward)
        return inside_streamed_chunk()
    config = getattr(parts.attention_module(layer), "config", None)
    if config is None and (parts.recurrent_mixer(layer) is not None or parts.positionwise_mixer(layer) is not None):
        config = parts.layer_config(layer)  # a recurrent layer (Mamba2Block, linear_attn), a hybrid's MLP block
    if getattr(config, STREAMING_FIELD, None) is None or not (layer.training and torch.is_grad_enabled()):
        return False
    return getattr(config, "model_type", None) in STREAMING_MODEL_TYPES and streaming_refusal(config) is None


# Arguments a chunk gets a fresh, empty one of: Gemma-4's `shared_kv_states`, where a layer stores its K/V for layers
# that read them (none does where layers stream: mst_core/families.py `streaming_unless`) and for its assistant models'
# generation. A stored chunk would keep its K/V, in the backward with their graph, until the step ends.
FRESH_PER_CHUNK = ("shared_kv_states",)


class StreamedCall:
    """One call of a decoder layer, split into query chunks."""

    def __init__(self, forward, layer, arguments, cache_name, records_router_logits=False):
        self.forward, self.layer, self.cache_name = forward, layer, cache_name
        attn = parts.attention_module(layer)
        config = attn.config
        hidden_states = arguments.pop("hidden_states")
        self.batch, self.seq_len = hidden_states.shape[:2]
        implementation = config._attn_implementation
        self.mask_name = parts.attention_mask_argument(layer)
        mask = arguments.pop(self.mask_name, None)
        # A shard of a sequence-parallel sequence (Ulysses): every chunk reads the whole sequence's keys, gathered
        # (mst_core/sharded_sequence.py), so each is "blind" below: its K/V first, its output once every key exists.
        self.sharded = mask if isinstance(mask, ShardedSequenceMask) else None
        # A recurrent mixer beside the attention in this layer (Falcon-H1): its states go from chunk to chunk as a
        # recurrent layer's do (recurrent.py), through the same cache object as the chunk's K/V.
        self.states_mixer = parts.mixer_beside_attention(layer)
        if self.states_mixer is not None:
            refuse_packed_sequences(layer, arguments)
            if self.sharded is not None:
                raise ValueError(
                    f"{STREAMING_FIELD}: {type(layer).__name__} runs attention and a recurrent mixer side by side, "
                    "which does not stream under sequence parallelism (each rank's mixer would start from a zero "
                    "state). Unset the field, or train without Ulysses."
                )
        if self.sharded is not None:
            self.sharded.check_streamable(attn)
            mask, self.bottom_right = None, False
        else:
            self.bottom_right = check_attention_call(layer, mask, self.batch, self.seq_len)
        self.flash = implementation == FLASH_ATTENTION
        self.mask, self.window, self.device = mask, sliding_window(attn), hidden_states.device
        if self.window is not None and self.window >= self.seq_len:
            self.window = None  # a window longer than the sequence cuts nothing
        self.arguments = arguments
        self.row_inputs = row_inputs(arguments, self.batch, self.seq_len)
        # No mask, no window, no dropout: torch's lower-right causal bias (no [chunk, keys] mask tensor; SDPA picks
        # its causal kernels, aligned bottom-right) instead of a bool mask built per chunk.
        self.causal_bias = mask is None and self.window is None and not (attn.training and getattr(attn, "attention_dropout", 0.0))
        chunk = streaming_chunk_size(getattr(config, STREAMING_FIELD), config.hidden_size,
                                     policy_device_type(hidden_states))
        if self.states_mixer is not None:  # no one-token chunk after the first (states.py)
            self.chunks = state_chunks(self.seq_len, chunk)
            chunk = max(end - start for start, end in self.chunks)
        else:
            self.chunks = [(start, min(start + chunk, self.seq_len)) for start in range(0, self.seq_len, chunk)]
        if self.sharded is not None:
            self.flash, self.causal_bias = False, False
            self.key_ranges = [(0, self.seq_len * self.sharded.world_size)] * len(self.chunks)
            self.blind = set(range(len(self.chunks)))
        elif self.flash:
            # Packing is given to each chunk as its own cu_seq_lens (FlashAttention masks per sequence itself).
            starts = packed_sequence_starts(mask, arguments, self.batch, self.seq_len)
            for name in FLASH_VARLEN_KWARGS:
                arguments.pop(name, None)
            self.key_ranges, self.flash_kwargs, self.silent_rows = plan_flash_chunks(
                mask, self.chunks, self.window, starts, self.device
            )
            self.blind = set()
        else:
            self.key_ranges, self.blind = plan_key_ranges(mask, self.chunks, self.window, self.seq_len)
        if self.states_mixer is not None and self.blind != set(range(len(self.blind))):
            raise ValueError(
                f"{STREAMING_FIELD}: {type(layer).__name__} runs attention and a recurrent mixer side by side, so its "
                "query chunks that read keys after their own rows (a bidirectional block of the mask) must start the "
                f"sequence, as left padding's do; here chunks {sorted(self.blind)} of {len(self.chunks)}. Unset the "
                "field for this batch's mask."
            )
        # The mixer's states at each chunk's start (conv, recurrent), recorded by the forward: None until known; no
        # list where no mixer carries states (the chunk driver's `starts`, driver.py).
        self.starts = None if self.states_mixer is None else [(None, None)] + [None] * (len(self.chunks) - 1)
        self.uncalled_parameters = set()  # ids (wrappers.noting_uncalled_parameters)
        self.chunk_rng, self.kv_rng = None, {}
        # The chunks' masks as views of one tensor (masks.OffsetChunkMasks), on the CPU where the model passed no
        # mask and the attention is not split by the causal bias (masks.OwnKeysCausalBias: float32/64), inside
        # `views_of_one_mask` (the Function's forward, its backward): built once the K/V dtype is known (the first
        # chunk's cache update; SDPA wants a float mask in the queries' dtype), freed on leaving.
        self.chunk_size, self.keys_dtype, self.offset_masks = chunk, None, None
        self.use_offset_masks = self.mask is None and not self.flash and self.sharded is None and self.device.type == "cpu"
        self.taking_views = False  # inside `views_of_one_mask`
        # The query projection a pass stopping at the cache skips (cache.queries_not_computed); set by
        # skip_and_record_projections on the Function's path only (under a wrapper's hooks every module runs as
        # upstream's).
        self.query_projection = None
        # The projections before the cache whose outputs the backward's K/V pass records for each chunk's recompute
        # (projections.py); set with `query_projection` (none recorded by default).
        self.recorded_projections = RecordedProjections([])
        self.records_router_logits = records_router_logits  # (router.py) known in the forward, kept for the backward

    @contextlib.contextmanager
    def views_of_one_mask(self):
        self.taking_views = self.use_offset_masks
        try:
            yield
        finally:
            self.taking_views, self.offset_masks = False, None

    def call(self, x_chunk, index, cache, rows=None, seam=None):
        """The layer's own forward on chunk `index` (rows of `x_chunk`; `rows`: the chunk's rows of `row_inputs` to
        pass instead of slices of them), its attention meeting `cache`: (its output,) or (its output, its router
        logits) (router.py); None where the layer stopped at the cache. A mixer beside the attention meets `seam`
        (states.py `StateSeam`), by default one from the start states the forward recorded, recording the end states
        of a chunk whose successor's are not known yet."""
        start, end = self.chunks[index]
        kv_start, kv_end = self.key_ranges[index]
        kwargs = {name: slice_rows(value, start, end, self.seq_len) for name, value in self.arguments.items()}
        kwargs.update(rows or {})
        kwargs.update({name: type(kwargs[name])() for name in FRESH_PER_CHUNK if kwargs.get(name) is not None})
        if cache.stop:  # the layer stops at the cache: no mask needed
            kwargs[self.mask_name] = None
        elif self.sharded is not None:
            kwargs[self.mask_name] = self.sharded.query_chunk(
                start, end, self.arguments.get("position_ids"), lower_right_causal_bias
            )
        elif self.flash:
            kwargs[self.mask_name] = flash_chunk_mask(self.mask, kv_start, kv_end, self.silent_rows[index])
            kwargs.update(self.flash_kwargs[index])
            cache.silent_rows = self.silent_rows[index]
        elif self.mask is None and self.bottom_right:
            kwargs[self.mask_name] = None
        elif self.taking_views and self.keys_dtype is not None and not (
            self.causal_bias and splits_on_cpu(self.keys_dtype)  # the bias splits the attention itself (masks.py)
        ):
            if self.offset_masks is None:
                self.offset_masks = OffsetChunkMasks(
                    self.chunk_size, self.seq_len, self.window, self.keys_dtype, self.device
                )
            kwargs[self.mask_name] = self.offset_masks.view(end - start, kv_end - kv_start)
        else:
            kwargs[self.mask_name] = chunk_mask(
                self.mask, self.batch, start, end, kv_start, kv_end, self.window, self.device, self.causal_bias
            )
        kwargs[self.cache_name] = cache
        recording = None
        if self.states_mixer is not None:
            if seam is None:
                if self.starts[index] is None:
                    raise RuntimeError(
                        f"streaming backward: {type(self.layer).__name__}'s chunk {index} ran before the mixer's "
                        "state at its start was known. Please report this with your setup."
                    )
                seam = recording = StateSeam(*self.starts[index])
            kwargs[self.cache_name] = StatesBesideKeysValues(cache, seam)
        # The tokens before the chunk in the whole sequence (under Ulysses, the earlier ranks' shards too).
        cache.tokens_before = start + (self.sharded.first_token if self.sharded is not None else 0)
        try:
            # The mini-sequence MLP runs unsplit in a streamed chunk (mst_core/chunks.py); a pass that stops at the
            # cache skips the query projection.
            with (
                one_streamed_chunk(),
                queries_not_computed(self.query_projection if cache.stop else None),
                router.chunk_collector(self.records_router_logits) as collected,
            ):
                out = self.forward(self.layer, x_chunk, **kwargs)
        except StopAfterKeysValues:
            self._keep_end_states(index, recording)
            return None
        except Exception as error:
            if not cache.updated:  # e.g. the chunk's mask did not fit keys that never went through the cache
                raise self._not_streamable() from error
            raise
        if not cache.updated:
            raise self._not_streamable()
        if seam is not None and not seam.met:
            raise ValueError(
                f"{STREAMING_FIELD}: {type(self.layer).__name__} cannot be streamed: its recurrent mixer never read "
                "its state from the cache (`get_conv_state` / `get_recurrent_state`). Unset the field for this model."
            )
        self._keep_end_states(index, recording)
        self.keys_dtype = cache.keys_dtype
        if isinstance(out, tuple):  # Bamba's (hidden states, attention weights): parts.returned gives it back
            out = out[0]
        logits = router.chunk_logits(collected, self.layer, self.batch, end - start)
        return (out,) if logits is None else (out, logits)

    def attention_before_mixer(self):
        """The error for a layer whose attention runs before its mixer (Zamba2's hybrid layers), given a chunk whose
        rows see no key."""
        return ValueError(
            f"{STREAMING_FIELD}: {type(self.layer).__name__} runs its attention before its recurrent mixer, so a query "
            f"chunk holding rows that see no key (left padding; here chunks {sorted(self.blind)}) cannot stream: the "
            "state it hands the next chunk would depend on keys after its rows. Pad the batch on the right, or unset "
            "the field."
        )

    def _keep_end_states(self, index, seam):
        """Chunk `index + 1`'s start states, copies of `seam`'s end states (the conv state is a view of the chunk's
        joined inputs), if not known yet and the mixer ran (a layer stopped at the cache before its mixer leaves none)."""
        if seam is None or index + 1 == len(self.chunks) or self.starts[index + 1] is not None:
            return
        if any(state is not None for state in seam.end_states()):
            self.starts[index + 1] = tuple(None if s is None else s.detach().clone() for s in seam.end_states())

    def _not_streamable(self):
        return ValueError(
            f"{STREAMING_FIELD}: {type(self.layer).__name__} cannot be streamed: its attention never called the "
            "cache's `update` with its keys and values (e.g. linear attention or a layer that ignores the cache). "
            "Unset the field for this model."
        )

    def keys_values_only(self, rows, buffers):
        """Every chunk's K/V into `buffers` (the layer stopped at the cache), each pass replaying the RNG state of the
        forward pass that wrote them (`keys_values_rng`): the same dropout draws, the same K/V."""
        for index, (start, end) in enumerate(self.chunks):
            rng = self.keys_values_rng(index)
            with restore_rng_state(rng, self.device), self.recorded_projections.recording(index):
                self.call(rows(start, end), index, RecordingCache(buffers, start, end, start, end, stop=True))

    def keys_values_rng(self, index):
        """The RNG state of the forward pass that wrote chunk `index`'s K/V: a blind chunk's K/V-only pass, else its
        one pass."""
        return self.kv_rng.get(index, self.chunk_rng[index])

    def forward_order(self):
        """Chunks in the forward's order: a chunk reading every key (blind, see masks.plan_key_ranges) last."""
        return [i for i in range(len(self.chunks)) if i not in self.blind] + sorted(self.blind)

    def run(self, x, record_rng=False):
        """The whole layer's outputs without graph ((out,) or (out, router logits), as `call`), and the K/V buffers."""
        buffers = [None, None, self.seq_len]
        outputs = ChunkOutputs(self.batch, self.seq_len)
        if record_rng:
            self.chunk_rng, self.kv_rng = [None] * len(self.chunks), {}
        for index in sorted(self.blind):  # their keys first; their outputs once every key exists
            start, end = self.chunks[index]
            if record_rng:
                self.kv_rng[index] = capture_rng_state(x.device)
            self.call(x[:, start:end], index, RecordingCache(buffers, start, end, start, end, stop=True))
        if self.states_mixer is not None and any(self.starts[i + 1] is None for i in self.blind if i + 1 < len(self.chunks)):
            raise self.attention_before_mixer()  # the K/V-only passes stopped before the mixer
        if self.sharded is not None:  # this shard's K/V -> the whole sequence's for this rank's heads
            buffers[0], buffers[1] = self.sharded.gather_keys_values(buffers[0], buffers[1])
        for index in self.forward_order():
            start, end = self.chunks[index]
            if record_rng:
                self.chunk_rng[index] = capture_rng_state(x.device)
            # A blind chunk keeps the K/V its first pass wrote, which the other chunks read.
            cache = RecordingCache(buffers, start, end, *self.key_ranges[index], write=index not in self.blind)
            outputs.put(self.call(x[:, start:end], index, cache), start, end)
        return outputs.result(), buffers[0], buffers[1]


class StreamedLayerFunction(torch.autograd.Function):
    """Inputs: x [B, S, d], the `StreamedCall`, whether to keep x in host memory, the call's `row_inputs` (their
    order), the layer's parameters that require grad (plain leaf parameters: mst_core/wrappers.py). Saves x only (the
    row inputs are held by the `StreamedCall`'s arguments)."""

    @staticmethod
    def forward(ctx, x, streamed, storage, *tensors):
        ctx.autocast_state = capture_autocast_state(x.device.type)
        ctx.streamed, ctx.params = streamed, tensors[len(streamed.row_inputs) :]
        keep_input(ctx, x, storage)
        with streamed.views_of_one_mask(), noting_uncalled_parameters(streamed.layer, streamed.uncalled_parameters):
            outputs, keys, values = streamed.run(x, record_rng=True)
        del keys, values
        return outputs if len(outputs) > 1 else outputs[0]

    @staticmethod
    def backward(ctx, grad_out, grad_router_logits=None):
        refuse_create_graph("streaming backward", STREAMING_FIELD)
        return LayerBackward(ctx, grad_out, grad_router_logits).run()


def _forward_with_checkpoints(streamed, x):
    """Autograd fallback for layers whose weights a wrapper may swap (ZeRO-3, FSDP1: mst_core/wrappers.py): the
    layer checkpointed as a whole; inside, K/V of every chunk (layer stopped at the cache), then each chunk's
    output under its own checkpoint, reading those K/V. Every gradient goes through ordinary autograd.

    The chunks' checkpoints read the layer input and the K/V from `ChunkSource`s, saved once before the chunks: the
    layer's recompute then stops after its K/V pass, and each token goes through the layer's MLP twice a step (the
    forward, its chunk's recompute), as under checkpointing, not a third time in the layer's recompute."""
    from torch.utils.checkpoint import checkpoint

    def seam(chunk_states):  # a mixer beside the attention (Falcon-H1) starts from them, with their graph
        return None if streamed.states_mixer is None else StateSeam(*chunk_states)

    def chunk_output(x_chunk, keys, values, index, *states):
        """(out,) or (out, router logits); then the mixer's end states where one sits beside the attention."""
        chunk_seam = seam(states)
        outs = streamed.call(x_chunk, index, FixedCache(keys, values), seam=chunk_seam)
        return outs if chunk_seam is None else (*outs, *chunk_seam.end_states())

    def from_sources(sources, index, *states):
        start, end = streamed.chunks[index]
        kv_start, kv_end = streamed.key_ranges[index]
        x_all, keys, values = (source.tensor() for source in sources)
        return chunk_output(x_all[:, start:end], keys[:, :, kv_start:kv_end], values[:, :, kv_start:kv_end], index,
                            *states)

    def layer_body(x):
        parts, starts, states = [], [], (None, None)
        # Whether the K/V pass carries the mixer's states: it ran before the attention stopped at the cache (Falcon-H1's
        # order). Else (Zamba2's) each chunk's output pass hands the next its states, the chunks in order.
        keys_values_carry = streamed.states_mixer is not None
        for index, (start, end) in enumerate(streamed.chunks):
            cache, chunk_seam = _KeysValuesOnly(), seam(states)
            streamed.call(x[:, start:end], index, cache, seam=chunk_seam)
            parts.append((cache.keys, cache.values))
            starts.append(states)
            if chunk_seam is not None:
                states = chunk_seam.end_states()
                keys_values_carry = keys_values_carry and chunk_seam.met
        if streamed.states_mixer is not None and not keys_values_carry and streamed.blind:
            raise streamed.attention_before_mixer()
        keys = torch.cat([k for k, _ in parts], dim=2)
        values = torch.cat([v for _, v in parts], dim=2)
        del parts
        if streamed.sharded is not None:  # the whole sequence's K/V for this rank's heads (autograd: the way back)
            keys, values = streamed.sharded.gather_keys_values(keys, values)
        sources = None
        if x.requires_grad and keys.requires_grad and values.requires_grad:
            sources = [saved_once(tensor, len(streamed.chunks)) for tensor in (x, keys, values)]
        outs, states = [None] * len(streamed.chunks), (None, None)
        for index in streamed.forward_order():  # the Function's order: the same dropout draws
            start, end = streamed.chunks[index]
            kv_start, kv_end = streamed.key_ranges[index]
            chunk_states = starts[index] if keys_values_carry else states
            if sources is not None:
                outs[index] = checkpoint(from_sources, sources, index, *chunk_states, use_reentrant=False)
            else:
                outs[index] = checkpoint(
                    chunk_output, x[:, start:end], keys[:, :, kv_start:kv_end], values[:, :, kv_start:kv_end], index,
                    *chunk_states, use_reentrant=False,
                )
            if streamed.states_mixer is not None:
                outs[index], states = outs[index][:-2], outs[index][-2:]
        for source in sources or ():
            source.forward_done()
        out = torch.cat([chunk[0] for chunk in outs], dim=1)
        if len(outs[0]) == 1:
            return out
        return out, token_major([chunk[1] for chunk in outs], (streamed.batch,))

    return checkpoint(layer_body, x, use_reentrant=False)


class _KeysValuesOnly(FixedCache):
    stop = True

    def __init__(self):
        super().__init__(None, None)

    def _update(self, keys, values):
        self.keys, self.values = keys, values
        raise StopAfterKeysValues


def decoder_layer_forward(forward, layer, *args, **kwargs):
    """Streamed training forward of `layer` (`forward` is the layer class's own forward). While torch.compile
    traces, one operator of the graph where the call allows it (compiled.py), else the eager call (one graph break).
    A recurrent layer (the registry's `streaming_recurrent`) streams through its state, a hybrid's MLP or MoE block
    (Nemotron-H's) by chunks of tokens with no state (recurrent.py)."""
    if parts.inside_a_layer(layer):  # a decoder layer inside a streamed one's chunk: neither streamed nor checkpointed
        return forward(layer, *args, **kwargs)
    if torch.compiler.is_compiling():
        from . import compiled

        out = compiled.traced_call(layer, args, kwargs)
        if out is not None:
            return out
    if streams_through_states(layer):
        return _recurrent_eager_forward(forward, layer, *args, **kwargs)
    return _eager_forward(forward, layer, *args, **kwargs)


def _masks_built(layer, args, kwargs):
    """(args, kwargs) with each mask a compiled model decided on the host (mst_core/host_mask.py) built, for the
    eager call (a traced one crosses compiled.py's operator with it)."""
    config, like = parts.layer_config(layer), args[0] if args else kwargs["hidden_states"]
    args = tuple(value.built(config, like) if isinstance(value, HostMask) else value for value in args)
    return args, built_masks(config, kwargs, like)


def streams_through_states(layer) -> bool:
    """Whether `layer` streams by chunks of tokens through its recurrent state (recurrent.py; no state for a block
    that mixes no tokens), not by query chunks meeting the K/V cache (`StreamedCall`, with a mixer beside its attention
    carrying states too: Falcon-H1's)."""
    if parts.mixer_beside_attention(layer) is not None:
        return False
    return parts.recurrent_mixer(layer) is not None or parts.positionwise_mixer(layer) is not None


def _bound_arguments(forward, layer, args, kwargs):
    """(the call's arguments by name, without the layer and the cache; the cache argument's name; the cache given),
    after refusing an empty batch."""
    signature = inspect.signature(forward)
    bound = signature.bind(layer, *args, **kwargs)
    arguments = dict(bound.arguments)
    arguments.pop(next(iter(signature.parameters)))  # self
    arguments.update(arguments.pop("kwargs", {}))
    hidden_states = arguments["hidden_states"]
    if hidden_states.shape[0] == 0 or hidden_states.shape[1] == 0:
        raise ValueError(
            f"{STREAMING_FIELD}: the batch is empty (hidden_states of shape {tuple(hidden_states.shape)}); "
            "a training step needs at least one sequence of at least one token."
        )
    cache_name = "cache" if "cache" in signature.parameters else "past_key_values"
    given = [arguments.pop(name, None) for name in ("cache", "past_key_values")]
    return arguments, cache_name, next((c for c in given if c is not None), None)


def check_given_cache(layer, cache) -> None:
    """Refuse a cache (or None) that holds something for `layer`, which a streamed call neither reads nor fills:
    tokens for its attention, states for its recurrent mixer (both where a mixer sits beside the attention)."""
    recurrent_layer = streams_through_states(layer)
    if not recurrent_layer:
        check_cache_is_empty(layer, cache)
    if recurrent_layer or parts.mixer_beside_attention(layer) is not None:
        recurrent.check_cache_has_no_state(layer, cache)


def prepared_call(forward, layer, args, kwargs):
    """(the `StreamedCall` of this call, its hidden states), after the checks of a streamed call."""
    arguments, cache_name, given = _bound_arguments(forward, layer, args, kwargs)
    hidden_states = arguments["hidden_states"]
    check_given_cache(layer, given)
    collector = router.model_collector()
    check_captured_outputs(layer, collector)
    streamed = StreamedCall(forward, layer, arguments, cache_name, records_router_logits=router.recording(collector))
    return streamed, hidden_states


def skip_and_record_projections(streamed, layer):
    """On the Function's path (not under a wrapper's hooks, where every module runs as upstream's): the query
    projection the K/V passes skip and the projections whose outputs they record (cache.py, projections.py)."""
    streamed.query_projection = discardable_query_projection(parts.attention_module(layer))
    if streamed.sharded is not None:
        # Every chunk's output is backpropagated before any chunk's own K/V: the records of every chunk would be held
        # at once, as much memory as the shard's K/V. Its K/V projections are recomputed instead.
        return
    streamed.recorded_projections = RecordedProjections(
        recordable_projections(parts.attention_module(layer), skipped=streamed.query_projection)
    )


def prepared_recurrent_call(forward, layer, args, kwargs):
    """(the `recurrent.RecurrentCall` of this call, its hidden states), after the checks of a streamed call."""
    arguments, cache_name, given = _bound_arguments(forward, layer, args, kwargs)
    check_given_cache(layer, given)
    hidden_states = arguments.pop("hidden_states")
    return recurrent.prepared_call(forward, layer, hidden_states, arguments, cache_name), hidden_states


@torch.compiler.disable(reason="streaming_backward_chunk: a streamed recurrent layer runs eagerly in a compiled model")
def _recurrent_eager_forward(forward, layer, *args, **kwargs):
    """The streamed call of a recurrent layer run eagerly; under torch.compile where compiled.py's operator does not
    apply (one graph break)."""
    args, kwargs = _masks_built(layer, args, kwargs)
    call, hidden_states = prepared_recurrent_call(forward, layer, args, kwargs)
    return parts.returned(layer, router.hand_over(recurrent.streamed_outputs(call, layer, hidden_states)))


@torch.compiler.disable(reason="streaming_backward_chunk: a streamed layer runs eagerly inside a compiled model")
def _eager_forward(forward, layer, *args, **kwargs):
    """The streamed call run eagerly; under torch.compile where compiled.py's operator does not apply (one graph
    break). Dynamo cannot trace it: the backward takes `torch.autograd.grad` of each recomputed chunk, and the forward
    stops the layer at the cache by raising; traced, dynamo fell back to eager in parts of the layer with more breaks
    (11 against 5 on a 2-layer Llama at 2K tokens) and a slower step (docs/limits.md)."""
    args, kwargs = _masks_built(layer, args, kwargs)
    streamed, hidden_states = prepared_call(forward, layer, args, kwargs)
    # as many values as the layer's own forward returns (Bamba's: a tuple)
    return parts.returned(layer, router.hand_over(_streamed_outputs(streamed, layer, hidden_states)))


def _streamed_outputs(streamed, layer, hidden_states):
    """The streamed layer's output, or (output, router logits) (router.py), by the Function or the wrappers' fallback."""
    # The attention module is called (its hooks run); hooks other than output capturing may swap its weights
    # (FSDP2 `fully_shard` on it, accelerate): then ordinary autograd takes every gradient (the fallback).
    params = layer_parameters(layer)
    storage = input_storage(layer)
    if params is None:
        # ZeRO-3 leaf modules (MoE blocks) run once per chunk here; DeepSpeed reduces their weights once per call.
        # Its K/V passes skip the query projection, as the Function's do: q_proj sees each token twice a step.
        streamed.query_projection = discardable_query_projection(parts.attention_module(layer), hooks_run=True)
        with leaf_gradients_queued_once(layer), saved_tensors_offloaded(storage, hidden_states.device):
            return _forward_with_checkpoints(streamed, hidden_states)
    skip_and_record_projections(streamed, layer)
    if not (hidden_states.requires_grad or params or streamed.row_inputs):
        with torch.no_grad(), streamed.views_of_one_mask():
            outputs = streamed.run(hidden_states)[0]
        return outputs if len(outputs) > 1 else outputs[0]
    return StreamedLayerFunction.apply(hidden_states, streamed, storage, *streamed.row_inputs.values(), *params)

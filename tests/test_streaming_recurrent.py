"""streaming_backward_chunk on recurrent layers (streaming_backward/recurrent.py): each chunk the layer's own forward
from the state at its start, the backward from the last chunk carrying the states' gradients. Held to upstream's
unsplit fp32 step (the flag unset) with uneven chunks, batch 2, left padding, ignored labels, gradient accumulation,
and a wrapper's hooks. Hybrids (Qwen3.5, Qwen3-Next: Gated DeltaNet layers beside attention ones) stream both kinds of
layer in one step."""

import contextlib
import functools

import pytest
import torch
from test_streaming import flash_reference  # noqa: F401  (a pytest fixture)
from tiny_models import MOE_FAMILIES, RECURRENT_FAMILIES, REGISTRY, fp64_throughout, make_model

from transformers.mst_core.memory import LiveTensorTracker
from transformers.streaming_backward import config as streaming_config
from transformers.streaming_backward import layer as streamed_layer
from transformers.streaming_backward import parts, recurrent

SEQ = 45
CONV_STATE_ONLY = {"lfm2", "lfm2_moe"}  # short convolutions: no recurrent state
# Attention and a recurrent mixer side by side in every layer: streamed by query chunks, the mixer's states carried
# (streaming_backward/layer.py `states_mixer`); test_side_by_side_layers_meet_both_seams checks this set.
SIDE_BY_SIDE = {"falcon_h1", "zamba2"}
# Attention before the mixer in one layer (Zamba2's hybrid layers): a query chunk holding rows that see no key (left
# padding, with sdpa or eager attention) is refused (test_left_padding_refused_where_attention_precedes_the_mixer).
RIGHT_PADDED = {"zamba2"}
RTOL = 1e-5  # fp32: the same arithmetic in another order (the scan's blocks start at each chunk's start)
# Where fp32 rounding alone moves a gradient by more than RTOL (Gated DeltaNet's decay parameters `A_log`, `dt_bias`:
# a sum over every position of terms that nearly cancel; upstream's own fp32 step is 3e-5..6e-5 from its fp64 one),
# the same two steps are run again in fp64 throughout and held to this.
RTOL_FP64 = 1e-9


def _batch(seed=1, seq=SEQ, vocab=128, family=None):
    """Two rows, the second padded by 6 tokens: on the left, or on the right for the families whose streamed layers
    refuse left padding (RIGHT_PADDED)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (2, seq), generator=generator)
    mask = torch.ones_like(ids)
    if family in RIGHT_PADDED:
        mask[1, -6:] = 0
    else:
        mask[1, :6] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, 20:25] = -100
    return ids, mask, labels


def _step(family, chunk, batches, hooks=False, dtype=torch.float32, prepare=None, **fields):
    """Loss per micro-batch and every parameter's gradient, accumulated over `batches`; `prepare(model)` runs on the
    model first (the flash_attention_2 stand-in)."""
    if dtype == torch.float64:
        fields["experts_implementation"] = "eager"  # grouped_mm has no fp64 kernel
    model = make_model(family, streaming_backward_chunk=chunk, **fields).to(dtype).train()
    if prepare is not None:
        model = prepare(model)
    if hooks:  # as ZeRO-3 / accelerate put them: the layers take the checkpointed fallback
        for module in model.modules():
            module.register_forward_pre_hook(lambda module, args: None)
    return _step_on(model, batches)


def _step_on(model, batches):
    """(loss per micro-batch, {name: gradient} of the parameters that require grad), accumulated over `batches`."""
    losses = []
    for ids, mask, labels in batches:
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        losses.append(loss.detach())
    return torch.stack(losses), {name: p.grad for name, p in model.named_parameters() if p.requires_grad}


def _relative(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def _assert_close(got, want, in_fp64=None):
    """`got` (a streamed step) against `want` (upstream's unsplit fp32 step). `in_fp64`: a function giving the same
    two steps in fp64 throughout, for the gradients fp32 rounding alone moves by more than RTOL (RTOL_FP64)."""
    (got_losses, got_grads), (want_losses, want_grads) = got, want
    torch.testing.assert_close(got_losses, want_losses, rtol=RTOL, atol=0)
    for name, grad in want_grads.items():
        assert got_grads[name] is not None, f"{name} got no gradient"
        error = _relative(got_grads[name], grad)
        if error > RTOL and in_fp64 is not None:
            (_, got64), (_, want64) = in_fp64()
            error = _relative(got64[name], want64[name])
            assert error <= RTOL_FP64, (name, "fp64", error)
            continue
        assert error <= RTOL, (name, error)


def _assert_exact(got, family, chunk, batches, want=None, prepare=None, **fields):
    """`got` (the streamed step with `chunk` and `fields`) against upstream's unsplit step on `batches` (`want` if
    computed already); where fp32 rounding alone moves a gradient by more than RTOL, both steps again in fp64.
    `prepare`: as `_step`'s, for both steps."""
    want = want or _step(family, None, batches, prepare=prepare)

    @functools.cache
    def in_fp64():
        with fp64_throughout(family):
            return (_step(family, chunk, batches, dtype=torch.float64, prepare=prepare, **fields),
                    _step(family, None, batches, dtype=torch.float64, prepare=prepare))

    _assert_close(got, want, in_fp64)


def _by_tokens(layer):
    """Whether the recurrent Function streams `layer`: a recurrent mixer's, or a hybrid's block that mixes no tokens
    (Nemotron-H's MLP and MoE blocks, since 5.24.0+mst.36)."""
    return parts.recurrent_mixer(layer) is not None or parts.positionwise_mixer(layer) is not None


def _recurrent_layers(model):
    """Decoder layers the recurrent Function streams (not one inside another: Zamba2's hybrid layers hold a Mamba2
    layer)."""
    return sum(_by_tokens(layer) and not parts.inside_a_layer(layer) for layer in model.modules())


def _streamed_kinds(model):
    """Which streamed Function each decoder layer of `model` calls, in order (`_streamed_layer_calls`)."""
    return ["recurrent" if _by_tokens(layer) and parts.mixer_beside_attention(layer) is None else "attention"
            for layer in model.model.layers if _by_tokens(layer) or parts.attention_module(layer) is not None]


@pytest.fixture
def streamed_calls(monkeypatch):
    """The streamed Functions' calls of layers carrying a state and their chunks (so that no test compares the unsplit
    step with itself): the recurrent layers' Function, and the streamed layer's where a mixer sits beside the
    attention (Falcon-H1)."""
    calls = []
    apply = recurrent.StreamedRecurrentFunction.apply
    layer_apply = streamed_layer.StreamedLayerFunction.apply

    def counted(x, call, *params):
        calls.append(list(call.chunks))
        return apply(x, call, *params)

    def counted_layer(x, streamed, *rest):
        if streamed.states_mixer is not None:
            calls.append(list(streamed.chunks))
        return layer_apply(x, streamed, *rest)

    monkeypatch.setattr(recurrent.StreamedRecurrentFunction, "apply", counted)
    monkeypatch.setattr(streamed_layer.StreamedLayerFunction, "apply", counted_layer)
    return calls


@pytest.mark.parametrize("family", sorted(RECURRENT_FAMILIES))
@pytest.mark.parametrize("chunk", [1, 7, SEQ - 2, SEQ - 1, SEQ + 5, "auto"])
def test_exact_against_the_unsplit_step(family, chunk, streamed_calls, monkeypatch):
    monkeypatch.setattr(streaming_config, "MIN_AUTO_CHUNK", 16)  # "auto" = max(hidden_size 32, 16): it streams
    batches = [_batch(family=family)]
    _assert_exact(_step(family, chunk, batches), family, chunk, batches)
    assert streamed_calls, "the streamed Function did not run"
    chunks = streamed_calls[0]
    assert chunks[0][0] == 0 and chunks[-1][1] == SEQ and all(b - a >= 2 for a, b in chunks)
    # chunks of 1 are taken as 2, and a last chunk of 1 joins the one before (recurrent.py)
    size = {1: 2, 7: 7, SEQ - 2: SEQ - 2, SEQ - 1: SEQ, SEQ + 5: SEQ, "auto": 32}[chunk]
    assert chunks[0] == (0, size)


# The blocks each tiny model runs by mini-sequences in one forward with `mini_sequence_chunk` alone: its MLP / MoE blocks
# (Granite-4.0-H's MoE block with its shared MLP, OLMo-Hybrid's attention layer's MLP with its post-feedforward norm:
# one each) and its final norm; the Mamba families have no MLP, Zamba2's MLP (per-layer adapters) is not chunked.
CHUNKED_BLOCKS = {"mamba2": 1, "mamba": 1, "falcon_mamba": 1, "nemotron_h": 3, "zamba2": 1}


@pytest.mark.parametrize("family", sorted(RECURRENT_FAMILIES))
@pytest.mark.parametrize("streaming", [None, 7])
def test_with_mini_sequences(family, streaming, streamed_calls, monkeypatch):
    """mini_sequence_chunk (the MLP / MoE blocks, the final norm and the LM head + loss by chunks of 16), alone and
    with streamed layers, where the streamed layers run their MLPs unsplit (one chunk bounds them), Nemotron-H's MLP
    and MoE blocks, layers of their own, too (they stream by chunks of tokens since 5.24.0+mst.36)."""
    from transformers.mini_sequence import mlp as mini_sequence_mlp

    chunked = []
    apply = mini_sequence_mlp._MiniSequenceMLPFunction.apply

    def counted(x, chunk_size, forward_fn, module, *rest):
        chunked.append(module)
        return apply(x, chunk_size, forward_fn, module, *rest)

    monkeypatch.setattr(mini_sequence_mlp._MiniSequenceMLPFunction, "apply", counted)
    batches = [_batch(family=family)]
    ids, mask, labels = batches[0]
    out = make_model(family, mini_sequence_chunk=16).train()(input_ids=ids, attention_mask=mask, labels=labels)
    assert (out.logits is None) == (REGISTRY[family].mini_sequence is not None)  # the chunked loss: no logits
    assert len(chunked) == CHUNKED_BLOCKS.get(family, 3), chunked
    chunked.clear()
    got = _step(family, streaming, batches, mini_sequence_chunk=16)
    if streaming is not None:  # the final norm only
        assert len(chunked) == 1, chunked
    _assert_exact(got, family, streaming, batches, mini_sequence_chunk=16)
    assert bool(streamed_calls) == (streaming is not None)


def test_bamba_z_loss_keeps_the_unsplit_head(caplog):
    """Bamba's z-loss (`z_loss_coefficient`) is over the whole logits: with it on, the head and loss run upstream's
    unsplit lines, warned, and the step (streamed layers included) is upstream's, z-loss and all."""
    import logging

    batches = [_batch()]
    ids, mask, labels = batches[0]
    with caplog.at_level(logging.WARNING):
        out = make_model("bamba", mini_sequence_chunk=16, z_loss_coefficient=0.37).train()(
            input_ids=ids, attention_mask=mask, labels=labels)
    assert out.logits is not None and "z_loss_coefficient=0.37 adds a z-loss" in caplog.text
    plain = make_model("bamba").train()(input_ids=ids, attention_mask=mask, labels=labels).loss
    assert out.loss.item() > plain.item()  # the z-loss term is in it
    fields = dict(mini_sequence_chunk=16, z_loss_coefficient=0.37)

    @functools.cache
    def in_fp64():
        with fp64_throughout("bamba"):
            return (_step("bamba", 7, batches, dtype=torch.float64, **fields),
                    _step("bamba", None, batches, dtype=torch.float64, z_loss_coefficient=0.37))

    _assert_close(_step("bamba", 7, batches, **fields), _step("bamba", None, batches, z_loss_coefficient=0.37), in_fp64)


@pytest.mark.parametrize("family", sorted(RECURRENT_FAMILIES))
def test_gradient_accumulation_and_hooks(family, streamed_calls):
    batches = [_batch(1, family=family), _batch(2, seq=30, family=family)]
    want = _step(family, None, batches)
    got = _step(family, 7, batches)
    assert len(streamed_calls) == 2 * _recurrent_layers(make_model(family))  # each recurrent layer, 2 micro-batches
    _assert_exact(got, family, 7, batches, want)
    streamed_calls.clear()
    got = _step(family, 7, batches, hooks=True)
    assert not streamed_calls  # the checkpointed fallback ran
    _assert_exact(got, family, 7, batches, want, hooks=True)


@pytest.mark.parametrize("family", sorted(RECURRENT_FAMILIES))
def test_a_planted_error_in_the_carried_state_fails(family, monkeypatch):
    """The comparisons above can fail, or the backward refuses: a recurrent state that reaches the next chunk
    without its gradient path (as a fused kernel that dropped it would) is refused by the Function and moves the
    gradients under the wrappers' checkpointed chunks; a conv state left out moves the loss. (LFM2's short
    convolutions carry a conv state only.)"""
    batches = [_batch(family=family)]
    want = _step(family, None, batches)
    if family in CONV_STATE_ONLY:
        monkeypatch.setattr(recurrent.StateSeam, "get_recurrent_state", lambda self, *args, **kwargs: pytest.fail(
            "a conv-only layer read a recurrent state"))
    get_state = recurrent.StateSeam.get_recurrent_state
    monkeypatch.setattr(recurrent.StateSeam, "get_recurrent_state",
                        lambda self, *args, **kwargs: None if (s := get_state(self, *args, **kwargs)) is None
                        else s.detach())
    if family not in CONV_STATE_ONLY:
        with pytest.raises(RuntimeError, match="returned no gradient for the state it started from"):
            _step(family, 7, batches)
        with pytest.raises(AssertionError):
            _assert_exact(_step(family, 7, batches, hooks=True), family, 7, batches, want, hooks=True)
    monkeypatch.undo()
    update_conv = recurrent.StateSeam.update_conv_state

    def conv_from_zeros(self, *args, **kwargs):  # each chunk's convolution without the previous chunk's inputs
        self.conv_state = None
        return update_conv(self, *args, **kwargs)

    monkeypatch.setattr(recurrent.StateSeam, "update_conv_state", conv_from_zeros)
    with pytest.raises(RuntimeError, match="returned no gradient for the state it started from"):
        _step(family, 7, batches)
    with pytest.raises(AssertionError):
        _assert_exact(_step(family, 7, batches, hooks=True), family, 7, batches, want, hooks=True)


@pytest.mark.parametrize("family", sorted(RECURRENT_FAMILIES))
def test_a_cache_holding_a_state_is_refused(family):
    model = make_model(family, streaming_backward_chunk=7).train()
    ids, _, _ = _batch(family=family)
    with torch.no_grad():  # a forward without gradients fills the cache, as upstream's
        cache = model(input_ids=ids, use_cache=True).past_key_values
    # Falcon-H1's layers (attention beside the mixer) are refused for the cached keys first
    with pytest.raises(ValueError, match="holds (layer 0's state from an earlier call|45 cached tokens)"):
        model(input_ids=ids, cache=cache, use_cache=True)


# Families whose CPU scans loop over the tokens (upstream's reference paths) are measured at a quarter of the lengths,
# in chunks of 32, which quarters their time; the property holds there with a wide margin (measured: peak ratio
# 0.07-0.10, gap growth 4.4-5.2). Elsewhere the longer lengths keep a margin (LFM2's ratio: 0.50 at 1024 tokens in
# chunks of 32, 0.49 at 2048 in chunks of 64).
SHORTER_LENGTHS = {"mamba", "falcon_mamba", "jamba", "kimi_linear"}


def _assert_one_chunk_held(family, below, **overrides):
    """The streamed step's peak (chunks of 64) at 4096 tokens (chunks of 32 at 1024: `SHORTER_LENGTHS`) is below
    `below` times checkpointing's and below half the same streamed step's in one chunk (a chunk loop that kept every
    chunk's activations would hold as much: measured 0.07-0.42), and the gap to checkpointing's grows more than 3.5x
    from 1024 to 4096 tokens (256 to 1024): live tensor bytes, fp32. (Against checkpointing alone, a Mamba layer
    streamed in one chunk already holds 0.32x: its scan from the carried state keeps less than upstream's.)"""

    def peak(seq, chunk):
        model = make_model(family, streaming_backward_chunk=chunk, vocab_size=16, **overrides).train()
        if chunk is None:
            model.activation_checkpointing_enable()
        ids = torch.randint(1, 16, (1, seq), generator=torch.Generator().manual_seed(0))
        with LiveTensorTracker(keep_largest=0) as tracker:
            model(input_ids=ids, labels=ids).loss.backward()
        return tracker.peak_bytes

    lengths, chunk = ((256, 1024), 32) if family in SHORTER_LENGTHS else ((1024, 4096), 64)
    streamed = [peak(seq, chunk) for seq in lengths]
    checkpointed = [peak(seq, None) for seq in lengths]
    assert streamed[1] < below * checkpointed[1], (streamed, checkpointed)
    one_chunk = peak(lengths[1], lengths[1])
    assert streamed[1] < 0.5 * one_chunk, (streamed, one_chunk)
    gaps = [c - s for c, s in zip(checkpointed, streamed)]
    assert gaps[1] > 3.5 * gaps[0], (streamed, checkpointed)


@pytest.mark.parametrize("family", sorted(RECURRENT_FAMILIES))
def test_the_backward_holds_one_chunk(family):
    """StreamBP's property for recurrent layers: a layer's recompute holds one chunk's activations, where
    checkpointing's holds the sequence's (live tensor bytes, fp32; both keep the layer inputs, and the rest of the step
    (final norm, LM head) is the same). So the gap grows with the length as the sequence's activations do."""

    _assert_one_chunk_held(family, below=0.5)


def test_blocks_that_mix_no_tokens_stream_too():
    """Nemotron-H's MLP and MoE blocks, layers of their own, stream by chunks of tokens (since 5.24.0+mst.36): with
    the field set (which replaces checkpointing) their recompute holds one chunk's activations. Before, they were
    neither streamed nor checkpointed and kept the whole sequence's MLP activations: above checkpointing's peak."""

    # No cache (use_cache=False): a model without attention layers cannot make one.
    _assert_one_chunk_held("nemotron_h", below=0.7, intermediate_size=256, moe_intermediate_size=64,
                           layers_block_type=["mlp", "moe"], num_hidden_layers=2, use_cache=False)


@pytest.mark.parametrize("family", sorted(RECURRENT_FAMILIES))
def test_offloaded_input_read_back_by_chunks(family, streamed_calls):
    """activation_checkpointing_enable(offload=True) with streaming: each streamed layer keeps its input in host
    memory (one save per layer and step) and its backward reads it back one chunk at a time; exact."""
    from test_streaming import RecordingHostStorage, keep_offloaded_inputs_in

    storage = RecordingHostStorage()
    batches = [_batch(family=family)]
    model = make_model(family, streaming_backward_chunk=7).train()
    model.activation_checkpointing_enable(offload=True)
    keep_offloaded_inputs_in(model, storage)
    ids, mask, labels = batches[0]
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    got = (loss.detach()[None], {name: p.grad for name, p in model.named_parameters()})
    _assert_exact(got, family, 7, batches)
    layers = model.config.num_hidden_layers
    assert storage.saved == [tuple(ids.shape) + (model.config.hidden_size,)] * layers
    chunks = [(start, min(start + 7, SEQ)) for start in range(0, SEQ, 7)]
    if _recurrent_layers(model) == layers and family not in SIDE_BY_SIDE:
        assert storage.loads == list(reversed(chunks)) * layers  # each chunk's rows once, from the last
    else:  # a hybrid: layer 0 (linear attention) goes back last; an attention layer (Falcon-H1's too: its K/V pass
        # first) reads its rows as test_streaming's, its chunks' turns from the last
        assert storage.loads[-len(chunks):] == list(reversed(chunks))


@pytest.mark.parametrize("family", sorted(RECURRENT_FAMILIES))
def test_only_the_decoder_layers_stream(family):
    """`applies` (asked by GradientCheckpointingLayer, and by the planner for every module) is true for a training
    decoder layer only (Nemotron-H's MLP and MoE blocks, layers of their own there, included since 5.24.0+mst.36):
    not for the model around it, which carries the same config."""
    from transformers.streaming_backward import applies

    model = make_model(family, streaming_backward_chunk=7).train()
    streamed = model.config.num_hidden_layers
    assert [applies(module) for module in model.modules()].count(True) == streamed
    assert not any(applies(module) for module in model.eval().modules())


# Hybrids: recurrent layers beside attention layers (Qwen3.5, Qwen3-Next).
HYBRIDS = sorted(family for family in RECURRENT_FAMILIES if REGISTRY[family].streaming_attention)
# Hybrids with MoE blocks, whose routers record their logits; Nemotron-H's head adds no aux loss.
HYBRID_MOE = [family for family in HYBRIDS if family in MOE_FAMILIES or family in ("granitemoehybrid", "nemotron_h",
                                                                                   "lfm2_moe", "kimi_linear")]
NO_AUX_LOSS = {"nemotron_h", "lfm2_moe", "kimi_linear"}


def _streamed_layer_calls(monkeypatch):
    """Calls of the two streamed Functions: [("recurrent" | "attention", chunks)]."""
    calls = []
    for kind, function in (("recurrent", recurrent.StreamedRecurrentFunction),
                           ("attention", streamed_layer.StreamedLayerFunction)):
        monkeypatch.setattr(function, "apply",
                            lambda *args, kind=kind, real=function.apply: calls.append(kind) or real(*args))
    return calls


@pytest.mark.parametrize("family", HYBRID_MOE)
@pytest.mark.parametrize("variant", ["function", "fallback", "both fields"])
def test_hybrid_router_logits_and_aux_loss(family, variant, monkeypatch):
    """output_router_logits=True (the aux loss, weighted 1.0): every layer's MoE block records its router logits,
    the linear-attention layer's through the recurrent Function (or, under a wrapper's hooks, its checkpointed
    chunks), handed over whole with their graph; the loss, the aux loss, the logits and every gradient are
    upstream's. "both fields": with the LM head + loss by mini-sequences too, the aux loss added to the chunked
    loss by upstream's lines."""
    batches = [_batch(family=family)]
    fields = {"mini_sequence_chunk": 7} if variant == "both fields" else {}

    def step(chunk):
        model = make_model(family, streaming_backward_chunk=chunk, **(fields if chunk is not None else {})).train()
        if variant == "fallback" and chunk is not None:
            for module in model.modules():
                module.register_forward_pre_hook(lambda module, args: None)
        ids, mask, labels = batches[0]
        out = model(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True)
        out.loss.backward()
        return out, {name: p.grad for name, p in model.named_parameters()}

    calls = _streamed_layer_calls(monkeypatch)
    (out, grads), (ref, ref_grads) = step(7), step(None)
    assert calls == ([] if variant == "fallback" else _streamed_kinds(make_model(family)))
    if family == "nemotron_h" and variant != "fallback":  # its MoE and MLP blocks stream by tokens too
        assert calls == ["recurrent", "recurrent", "attention", "recurrent"]
    assert (out.logits is None) == bool(fields and REGISTRY[family].mini_sequence)  # the chunked loss ran
    if family in NO_AUX_LOSS:
        assert ref.aux_loss is None and out.aux_loss is None
    else:
        assert ref.aux_loss is not None and ref.aux_loss.item() > 0
        torch.testing.assert_close(out.aux_loss, ref.aux_loss, rtol=RTOL, atol=0)
    assert len(out.router_logits) == len(ref.router_logits) > 0
    for got, want in zip(out.router_logits, ref.router_logits):
        assert got.shape == want.shape and got.requires_grad
        torch.testing.assert_close(got, want, rtol=RTOL, atol=1e-6)
    _assert_exact((out.loss.detach()[None], grads), family, 7, batches, (ref.loss.detach()[None], ref_grads),
                  hooks=variant == "fallback", **fields)


@pytest.mark.parametrize("family", HYBRIDS)
def test_hybrid_with_flash_attention(family, flash_reference, monkeypatch):
    """flash_attention_2 (the reference kernels' stand-in): the attention layer streams with FlashAttention's
    padded path, the linear-attention layer through its state; exact."""
    batches = [_batch(family=family)]
    calls = _streamed_layer_calls(monkeypatch)
    got = _step(family, 7, batches, prepare=flash_reference, attn_implementation="sdpa")
    assert calls == _streamed_kinds(make_model(family)) and "reference_flash_varlen" in flash_reference.calls
    _assert_exact(got, family, 7, batches, prepare=flash_reference, attn_implementation="sdpa")


@pytest.mark.parametrize("family", HYBRIDS)
def test_packed_sequences_are_refused(family):
    """Packed sequences' boundaries (`cu_seq_lens_q`, which Gated DeltaNet hands its scan) are the whole sequence's:
    refused at the streamed layer, naming the argument, rather than given to each chunk."""
    model = make_model(family, streaming_backward_chunk=7).train()
    ids, _, labels = _batch(family=family)
    ids, labels = ids[:1], labels[:1]
    cu = torch.tensor([0, 20, SEQ], dtype=torch.int32)
    with pytest.raises(ValueError, match="packed sequences \\(`cu_seq_lens_q`\\)"):
        model(input_ids=ids, labels=labels, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=25, max_length_k=25)


def test_a_mixer_that_drops_the_carried_state_is_refused(monkeypatch):
    """Upstream's selective scan (Mamba's, FalconMamba's, Jamba's) starts every call from a zero state: it reads the
    cache's state only in its one-token decode step. In a streamed chunk the mixer takes ours from the carried state
    (adjoint_sharding/integration.py `selective_scan_for`); with upstream's planted there, each chunk would start
    afresh and no gradient would reach the state it was handed: the streamed backward refuses that chunk."""
    from transformers.adjoint_sharding import integration as adjoint_integration

    monkeypatch.setattr(adjoint_integration, "carried_states", lambda: None)
    with pytest.raises(RuntimeError, match="returned no gradient for the state it started from"):
        _step("mamba", 7, [_batch()])


def test_side_by_side_layers_meet_both_seams(monkeypatch):
    """Falcon-H1 runs attention and a Mamba2 mixer side by side in every layer: streamed by query chunks, the mixer's
    states carried from chunk to chunk (layer.py `states_mixer`), for the families of SIDE_BY_SIDE only. Left padding
    longer than a chunk makes chunks after the first blind (they read every key: their output is backpropagated
    before any chunk's turn), so their start states get gradients from two passes, summed: exact. (Dropping the early
    pass's share fails the chunks-of-1 case of test_exact_against_the_unsplit_step, measured.)"""
    from transformers.modeling_layers import GradientCheckpointingLayer

    for family in RECURRENT_FAMILIES:
        layers = [module for module in make_model(family).modules() if isinstance(module, GradientCheckpointingLayer)]
        assert any(parts.mixer_beside_attention(layer) is not None for layer in layers) == (family in SIDE_BY_SIDE)
    blind = []
    init = streamed_layer.StreamedCall.__init__

    def recorded(self, *args, **kwargs):
        init(self, *args, **kwargs)
        blind.append(set(self.blind))

    monkeypatch.setattr(streamed_layer.StreamedCall, "__init__", recorded)
    batches = [_batch()]  # row 1 left-padded by 6 tokens: chunks of 2 at 0, 2 and 4 hold rows that see no key
    _assert_exact(_step("falcon_h1", 2, batches), "falcon_h1", 2, batches)
    assert blind and all(chunks == {0, 1, 2} for chunks in blind), blind


def test_side_by_side_blind_chunks_after_unblind_ones_are_refused(monkeypatch):
    """A chunk reading keys after its own rows (a bidirectional block of a custom mask) runs after every other chunk;
    beside a mixer whose state goes from chunk to chunk that order cannot hold unless such chunks start the sequence:
    refused at the call, naming the chunks."""
    plan = streamed_layer.plan_key_ranges
    monkeypatch.setattr(streamed_layer, "plan_key_ranges", lambda *args: (plan(*args)[0], {1}))
    with pytest.raises(ValueError, match=r"must start the sequence, as left padding's do; here chunks \[1\] of 7"):
        _step("falcon_h1", 7, [_batch()])


def test_left_padding_refused_where_attention_precedes_the_mixer():
    """Zamba2's hybrid layers run their shared attention block before their mixer: a chunk holding rows that see no key
    (left padding) attends to every key, so the state it hands the next chunk would depend on keys after its rows,
    whose gradients are final before its turn. Refused by the Function and by the wrappers' fallback, naming the fix."""
    left_padded = [_batch()]
    for hooks in (False, True):
        with pytest.raises(ValueError, match="runs its attention before its recurrent mixer.*Pad the batch on the right"):
            _step("zamba2", 7, left_padded, hooks=hooks)


def test_parameters_of_uncalled_modules_only_go_without_a_gradient(monkeypatch):
    """Zamba2's shared block holds every hybrid layer's adapters and each layer calls its own: the other layers'
    adapters get no gradient from this layer's call, as in upstream's step (wrappers.py `noting_uncalled_parameters`).
    Any other parameter without one is refused: with nothing noted as uncalled, the same step raises."""
    from transformers.streaming_backward import wrappers

    noted = []
    note = wrappers.noting_uncalled_parameters

    def noting(layer, found):
        noted.append((layer, found))
        return note(layer, found)

    monkeypatch.setattr(streamed_layer, "noting_uncalled_parameters", noting)
    batches = [_batch(family="zamba2")]
    _assert_exact(_step("zamba2", 7, batches), "zamba2", 7, batches)
    # each hybrid layer leaves the other's adapters uncalled: 2 linear maps each for q, k, v and the MLP's gate_up
    assert [len(found) for _, found in noted] == [8, 8]
    monkeypatch.setattr(streamed_layer, "noting_uncalled_parameters", lambda layer, found: contextlib.nullcontext())
    with pytest.raises(RuntimeError, match="that requires grad got no gradient"):
        _step("zamba2", 7, batches)


@pytest.mark.parametrize("family", sorted(RECURRENT_FAMILIES))
def test_peft_lora_on_every_linear_layer(family, streamed_calls):
    """PEFT LoRA (dropout 0) on every linear layer but the mixers' `out_proj` (which PEFT refuses on Mamba-based models),
    the mixers' other projections included, the base weights frozen (the first layer's input then needs no gradient):
    the loss and the adapters' gradients as with the field unset. The adapters upstream's step leaves without a
    gradient (Jamba's `dt_proj`, whose weight its mixer reads without calling it; Zamba2's other layers' adapters) get
    none here either, and the step does not refuse them."""
    import peft
    batches = [_batch(family=family)]

    def step(chunk, dtype=torch.float32):
        fields = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
        model = make_model(family, streaming_backward_chunk=chunk, **fields).to(dtype).train()
        config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear",
                                 exclude_modules=["out_proj"], init_lora_weights=False)
        return _step_on(peft.get_peft_model(model, config), batches)

    got, want = step(7), step(None)
    assert streamed_calls and want[1] and all(".lora_" in name for name in want[1])
    missing = sorted(name for name, grad in want[1].items() if grad is None)
    assert missing == sorted(name for name, grad in got[1].items() if grad is None)
    # Only these go without one: `dt_proj`, whose weight the Mamba mixers read without calling it, and adapters of the
    # other hybrid layers (Zamba2); most adapters get a gradient
    assert all(".dt_proj." in name or "_adapter_list." in name for name in missing), missing
    assert len(want[1]) - len(missing) >= 4  # Mamba2: in_proj of 2 layers
    for name in missing:
        del got[1][name], want[1][name]

    @functools.cache
    def in_fp64():
        with fp64_throughout(family):
            return tuple((loss, {n: g for n, g in grads.items() if n not in missing})
                         for loss, grads in (step(7, torch.float64), step(None, torch.float64)))

    _assert_close(got, want, in_fp64)


# LoRA on projections after the mixers' conv only (and the MLPs'), the base weights frozen: the first layer's input and
# its mixer's input projection need no gradient, so the conv and recurrent states it carries from chunk to chunk have no
# graph. Mamba2's one projection after its conv is `out_proj`, which PEFT refuses on Mamba-based models.
AFTER_THE_CONV = ["gate_proj", "up_proj", "down_proj", "w1", "w2", "w3", "x_proj", "o_proj", "input_linear",
                  "output_linear"]


@pytest.mark.parametrize("family", sorted(f for f in RECURRENT_FAMILIES if f != "mamba2"))
def test_peft_lora_after_the_conv_only(family, streamed_calls):
    """The loss and every adapter's gradient as with the field unset, where the carried states have no graph in the
    first layer (AFTER_THE_CONV). Until 5.24.0+mst.39 the streamed backward handed such an end state to
    `autograd.grad` with the next chunk's gradient for it, which raised ("element 1 of tensors does not require grad"):
    this test failed for 13 of these 15 families (all but Nemotron-H and Zamba2), and LoRA on the MLP projections
    alone for 8 (Qwen3.5, Qwen3.5-MoE and Qwen3-Next among them)."""
    import peft
    batches = [_batch(family=family)]
    targets = AFTER_THE_CONV + (["out_proj"] if family == "lfm2_moe" else [])  # its conv's `out_proj`: no MLP to adapt

    def step(chunk):
        model = make_model(family, streaming_backward_chunk=chunk).train()
        config = peft.LoraConfig(r=4, lora_dropout=0.0, target_modules=targets, init_lora_weights=False)
        return _step_on(peft.get_peft_model(model, config), batches)

    (got_loss, got), (want_loss, want) = step(7), step(None)
    assert streamed_calls and want and all(".lora_" in name for name in want)
    assert [name for name, grad in got.items() if grad is None] == [n for n, grad in want.items() if grad is None]
    assert _relative(got_loss, want_loss) < RTOL
    for name, grad in want.items():
        if grad is not None:
            assert _relative(got[name], grad) < RTOL, name


def test_recurrent_layers_refuse_other_missing_gradients(monkeypatch):
    """The recurrent layers' Function exempts the same parameters only: with nothing noted as uncalled, Jamba's Mamba
    layers with LoRA on `in_proj` and `dt_proj` (whose weight the mixer reads without calling it: its adapters get no
    gradient) raise."""
    import peft
    monkeypatch.setattr(recurrent, "noting_uncalled_parameters", lambda layer, found: contextlib.nullcontext())
    model = peft.get_peft_model(make_model("jamba", streaming_backward_chunk=7).train(),
                                peft.LoraConfig(r=4, target_modules=["in_proj", "dt_proj"], init_lora_weights=False))
    with pytest.raises(RuntimeError, match="JambaMambaDecoderLayer's recomputation; refusing to return a missing"):
        _step_on(model, [_batch()])


@pytest.mark.parametrize("chunk", [7, 44])
def test_a_row_input_of_a_recurrent_layer_gets_its_gradient(chunk, monkeypatch):
    """A recurrent layer's other argument that is rows of the sequence and requires grad is a row input of its
    Function (since 5.24.0+mst.41): each chunk's recompute reads its rows as leaves, and their gradients come back
    row by row. Zamba2's Mamba2 layer reads `transformer_hidden_states` (added to its input): against the same call
    unstreamed; its `original_hidden_states`, passed and never read, gets no gradient, as from the unstreamed call."""
    model = make_model("zamba2", streaming_backward_chunk=chunk).train()
    layer = next(layer for layer in model.model.layers if type(layer).__name__ == "Zamba2MambaDecoderLayer")
    generator = torch.Generator().manual_seed(3)
    inputs = [torch.randn(2, SEQ, model.config.hidden_size, generator=generator) for _ in range(3)]
    seed = torch.randn(2, SEQ, model.config.hidden_size, generator=generator)
    functions = []
    monkeypatch.setattr(recurrent.StreamedRecurrentFunction, "apply",
                        _recording(recurrent.StreamedRecurrentFunction.apply, functions))

    def step(streamed):
        monkeypatch.setattr(model.config, "streaming_backward_chunk", chunk if streamed else None)
        x, original, transformer = (value.clone().requires_grad_() for value in inputs)
        out = layer(x, original_hidden_states=original, transformer_hidden_states=transformer)
        out.backward(seed)
        return x.grad, original.grad, transformer.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}

    want = step(streamed=False)
    layer.zero_grad()
    got = step(streamed=True)
    assert len(functions) == 1  # the streamed call went through the recurrent Function
    assert want[1] is None and got[1] is None
    for got_grad, want_grad in [(got[0], want[0]), (got[2], want[2]), *zip(got[3].values(), want[3].values())]:
        assert _relative(got_grad, want_grad) <= RTOL


def _recording(apply, calls):
    def recorded(*args):
        calls.append(args)
        return apply(*args)

    return recorded


@pytest.mark.parametrize("family", ["mamba", "falcon_mamba", "jamba"])
def test_a_long_chunk_scans_in_shards(family, monkeypatch):
    """A streamed chunk of a Mamba (v1) layer scans from its carried state in adjoint sharding's "auto" shards (128
    tokens, since 5.24.0+mst.41), not as one piece: a chunk of 200 tokens runs shards of 128 and 72, the sequence's
    second chunk (100 tokens) one shard, exact against the unsplit step (the shards hand each other the state)."""
    from transformers.adjoint_sharding import scan

    shards = []
    monkeypatch.setattr(scan, "_shards", lambda seq_len, shard, shards_of=scan._shards:
                        shards.append((seq_len, shard)) or shards_of(seq_len, shard))
    batches = [_batch(seq=300, family=family)]
    got = _step(family, 200, batches)
    assert (200, 128) in shards and (100, 128) in shards, shards
    _assert_exact(got, family, 200, batches)


@pytest.mark.parametrize(("family", "where"), [("llama", "attention"), ("nemotron_h", "stateless")])
def test_input_rows_without_a_gradient_are_refused(family, where, monkeypatch):
    """The chunk driver (driver.py) refuses to return a layer input's gradient with some rows missing. Planted: the
    recompute of one chunk hands back an output cut from its rows (tied to a parameter only): the last chunk of an
    attention layer (no later chunk reads its K/V), a chunk of a block that mixes no tokens (Nemotron-H's MLP blocks,
    no state to carry a gradient to its rows)."""
    cls = streamed_layer.StreamedCall if where == "attention" else recurrent.RecurrentCall
    real = cls.call

    def cut(self, x_chunk, index, *args, **kwargs):
        outs = real(self, x_chunk, index, *args, **kwargs)
        planted = outs and torch.is_grad_enabled() and index == len(self.chunks) - 1
        if planted and (where == "attention" or self.stateless):
            weight = next(p for p in self.layer.parameters() if p.requires_grad)
            outs = (outs[0].detach() + 0 * weight.sum(), *outs[1:])
        return outs

    monkeypatch.setattr(cls, "call", cut)
    with pytest.raises(RuntimeError, match="the layer input got a gradient for some rows only"):
        _step(family, 16, [_batch(family=family)])

"""streaming_backward_chunk on recurrent layers (streaming_backward/recurrent.py): each chunk the layer's own forward
from the state at its start, the backward from the last chunk carrying the states' gradients. Held to upstream's
unsplit fp32 step (the flag unset) with uneven chunks, batch 2, left padding, ignored labels, gradient accumulation,
and a wrapper's hooks."""

import pytest
import torch
from tiny_models import RECURRENT_FAMILIES, make_model

from transformers.mst_core.memory import LiveTensorTracker
from transformers.streaming_backward import config as streaming_config
from transformers.streaming_backward import recurrent

SEQ = 45
RTOL = 1e-5  # fp32: the same arithmetic in another order (the scan's blocks start at each chunk's start)


def _batch(seed=1, seq=SEQ, vocab=128):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (2, seq), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0  # left padding
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, 20:25] = -100
    return ids, mask, labels


def _step(family, chunk, batches, hooks=False, **fields):
    """Loss per micro-batch and every parameter's gradient, accumulated over `batches`."""
    model = make_model(family, streaming_backward_chunk=chunk, **fields).train()
    if hooks:  # as ZeRO-3 / accelerate put them: the layers take the checkpointed fallback
        for module in model.modules():
            module.register_forward_pre_hook(lambda module, args: None)
    losses = []
    for ids, mask, labels in batches:
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        losses.append(loss.detach())
    return torch.stack(losses), {name: p.grad for name, p in model.named_parameters()}


def _assert_close(got, want):
    (got_losses, got_grads), (want_losses, want_grads) = got, want
    torch.testing.assert_close(got_losses, want_losses, rtol=RTOL, atol=0)
    for name, grad in want_grads.items():
        assert got_grads[name] is not None, f"{name} got no gradient"
        error = ((got_grads[name] - grad).norm() / grad.norm()).item()
        assert error <= RTOL, (name, error)


@pytest.fixture
def streamed_calls(monkeypatch):
    """The streamed Function's calls and their chunks (so that no test compares the unsplit step with itself)."""
    calls = []
    apply = recurrent.StreamedRecurrentFunction.apply

    def counted(x, call, *params):
        calls.append(list(call.chunks))
        return apply(x, call, *params)

    monkeypatch.setattr(recurrent.StreamedRecurrentFunction, "apply", counted)
    return calls


@pytest.mark.parametrize("family", sorted(RECURRENT_FAMILIES))
@pytest.mark.parametrize("chunk", [1, 7, SEQ - 2, SEQ - 1, SEQ + 5, "auto"])
def test_exact_against_the_unsplit_step(family, chunk, streamed_calls, monkeypatch):
    monkeypatch.setattr(streaming_config, "MIN_AUTO_CHUNK", 16)  # "auto" = max(hidden_size 32, 16): it streams
    batches = [_batch()]
    _assert_close(_step(family, chunk, batches), _step(family, None, batches))
    assert streamed_calls, "the streamed Function did not run"
    chunks = streamed_calls[0]
    assert chunks[0][0] == 0 and chunks[-1][1] == SEQ and all(b - a >= 2 for a, b in chunks)
    # chunks of 1 are taken as 2, and a last chunk of 1 joins the one before (recurrent.py)
    size = {1: 2, 7: 7, SEQ - 2: SEQ - 2, SEQ - 1: SEQ, SEQ + 5: SEQ, "auto": 32}[chunk]
    assert chunks[0] == (0, size)


@pytest.mark.parametrize("family", sorted(RECURRENT_FAMILIES))
@pytest.mark.parametrize("streaming", [None, 7])
def test_with_mini_sequences(family, streaming, streamed_calls):
    """mini_sequence_chunk (the LM head + loss by chunks of 16), alone and with streamed layers."""
    batches = [_batch()]
    _assert_close(_step(family, streaming, batches, mini_sequence_chunk=16), _step(family, None, batches))
    assert bool(streamed_calls) == (streaming is not None)


@pytest.mark.parametrize("family", sorted(RECURRENT_FAMILIES))
def test_gradient_accumulation_and_hooks(family, streamed_calls):
    batches = [_batch(1), _batch(2, seq=30)]
    want = _step(family, None, batches)
    _assert_close(_step(family, 7, batches), want)
    assert len(streamed_calls) == 4  # 2 layers x 2 micro-batches
    streamed_calls.clear()
    _assert_close(_step(family, 7, batches, hooks=True), want)
    assert not streamed_calls  # the checkpointed fallback ran


@pytest.mark.parametrize("family", sorted(RECURRENT_FAMILIES))
def test_a_planted_error_in_the_carried_state_fails(family, monkeypatch):
    """The comparisons above can fail: a recurrent state that reaches the next chunk without its gradient moves the
    gradients; a conv state left out moves the loss."""
    batches = [_batch()]
    want = _step(family, None, batches)
    get_state = recurrent.StateSeam.get_recurrent_state
    monkeypatch.setattr(recurrent.StateSeam, "get_recurrent_state",
                        lambda self, *args, **kwargs: None if (s := get_state(self, *args, **kwargs)) is None
                        else s.detach())
    with pytest.raises(AssertionError):
        _assert_close(_step(family, 7, batches), want)
    monkeypatch.undo()
    update_conv = recurrent.StateSeam.update_conv_state

    def conv_from_zeros(self, *args, **kwargs):  # each chunk's convolution without the previous chunk's inputs
        self.conv_state = None
        return update_conv(self, *args, **kwargs)

    monkeypatch.setattr(recurrent.StateSeam, "update_conv_state", conv_from_zeros)
    with pytest.raises(AssertionError):
        _assert_close(_step(family, 7, batches), want)


@pytest.mark.parametrize("family", sorted(RECURRENT_FAMILIES))
def test_a_cache_holding_a_state_is_refused(family):
    model = make_model(family, streaming_backward_chunk=7).train()
    ids, _, _ = _batch()
    with torch.no_grad():  # a forward without gradients fills the cache, as upstream's
        cache = model(input_ids=ids, use_cache=True).past_key_values
    with pytest.raises(ValueError, match="holds layer 0's state from an earlier call"):
        model(input_ids=ids, cache=cache, use_cache=True)


@pytest.mark.parametrize("family", sorted(RECURRENT_FAMILIES))
def test_the_backward_holds_one_chunk(family):
    """StreamBP's property for recurrent layers: a layer's recompute holds one chunk's activations, where
    checkpointing's holds the sequence's (live tensor bytes, fp32; both keep the layer inputs, and the rest of the step
    (final norm, LM head) is the same). So the gap grows with the length as the sequence's activations do."""

    def peak(seq, chunk):
        model = make_model(family, streaming_backward_chunk=chunk, vocab_size=16).train()
        if chunk is None:
            model.activation_checkpointing_enable()
        ids = torch.randint(1, 16, (1, seq), generator=torch.Generator().manual_seed(0))
        with LiveTensorTracker(keep_largest=0) as tracker:
            model(input_ids=ids, labels=ids).loss.backward()
        return tracker.peak_bytes

    streamed = [peak(seq, 64) for seq in (1024, 4096)]
    checkpointed = [peak(seq, None) for seq in (1024, 4096)]
    assert streamed[1] < 0.5 * checkpointed[1], (streamed, checkpointed)
    gaps = [c - s for c, s in zip(checkpointed, streamed)]
    assert gaps[1] > 3.5 * gaps[0], (streamed, checkpointed)


@pytest.mark.parametrize("family", sorted(RECURRENT_FAMILIES))
def test_offloaded_input_read_back_by_chunks(family, streamed_calls):
    """activation_checkpointing_enable(offload=True) with streaming: each streamed layer keeps its input in host
    memory (one save per layer and step) and its backward reads it back one chunk at a time; exact."""
    from test_streaming import RecordingHostStorage, keep_offloaded_inputs_in

    storage = RecordingHostStorage()
    batches = [_batch()]
    model = make_model(family, streaming_backward_chunk=7).train()
    model.activation_checkpointing_enable(offload=True)
    keep_offloaded_inputs_in(model, storage)
    ids, mask, labels = batches[0]
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    got = (loss.detach()[None], {name: p.grad for name, p in model.named_parameters()})
    _assert_close(got, _step(family, None, batches))
    layers = model.config.num_hidden_layers
    assert storage.saved == [tuple(ids.shape) + (model.config.hidden_size,)] * layers
    chunks = [(start, min(start + 7, SEQ)) for start in range(0, SEQ, 7)]
    assert storage.loads == list(reversed(chunks)) * layers  # each chunk's rows once, from the last


@pytest.mark.parametrize("family", sorted(RECURRENT_FAMILIES))
def test_only_the_decoder_layers_stream(family):
    """`applies` (asked by GradientCheckpointingLayer, and by the planner for every module) is true for a training
    recurrent layer only: not for the model around it, which carries the same config."""
    from transformers.streaming_backward import applies

    model = make_model(family, streaming_backward_chunk=7).train()
    assert [applies(module) for module in model.modules()].count(True) == model.config.num_hidden_layers
    assert not any(applies(module) for module in model.eval().modules())

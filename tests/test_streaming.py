"""`streaming_backward_chunk` (StreamBP) on the four families: the flag, exactness against the
unsplit path, the attention traps of offset query chunks, errors, and memory.

Every comparison builds the same model twice from one seed, streaming off (upstream path) and on,
feeds both the same fresh random inputs, and compares the loss, the gradient of every parameter and
of `inputs_embeds` (helpers shared with test_mini_sequence_models.py).
"""

import contextlib
import importlib
import zlib

import pytest
import torch
import transformers
from test_mini_sequence_models import assert_close, batch, train_step
from tiny_models import COMMON, FAMILIES, make_config, make_model
from torch.nn.attention.bias import causal_lower_right
from transformers.mst_core.memory import LiveTensorTracker
from transformers.streaming_backward.config import streaming_chunk_size
from transformers.streaming_backward import layer as streamed_layer
from transformers.streaming_backward import masks, offload, rows

SEQ = 40
CHUNKS = [1, 7, 64, SEQ - 1, SEQ + 5, "auto"]
# Gemma-2 has no SDPA path upstream (soft-capped attention): eager only.
IMPLEMENTATIONS = [(f, i) for f in sorted(FAMILIES) for i in ("sdpa", "eager") if not (f == "gemma2" and i == "sdpa")]
WINDOWED = {  # config overrides that give every (or every other) layer a sliding window
    "mistral": lambda w: {"sliding_window": w},
    "qwen2": lambda w: {"use_sliding_window": True, "sliding_window": w, "max_window_layers": 0},
    "gemma2": lambda w: {"sliding_window": w},
}


def seed_of(*parts):
    return zlib.crc32("/".join(map(str, parts)).encode()) % 1000  # reproducible, unlike hash()


def compare_streaming(family, chunk, seed, model_kwargs=None, step_kwargs=None, inputs=None, prepare=None):
    """Flag off vs `streaming_backward_chunk=chunk` (plus whatever `model_kwargs` sets on both)."""
    model_kwargs, step_kwargs = model_kwargs or {}, step_kwargs or {}
    inputs = inputs if inputs is not None else batch(seed)
    results = []
    for value in (None, chunk):
        model = make_model(family, streaming_backward_chunk=value, **model_kwargs)
        if prepare is not None:
            model = prepare(model)
        results.append(train_step(model, *inputs, **step_kwargs))
    (ref, ref_grads, ref_embeds), (out, grads, embeds) = results
    assert_close(out.loss, ref.loss, what="loss")
    assert grads.keys() == ref_grads.keys() and ref_grads
    for name in ref_grads:
        assert_close(grads[name], ref_grads[name], what=name)
    assert_close(embeds, ref_embeds, what="inputs_embeds")
    return out


# ----------------------------------------------------------------------------- the flag


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("bad", [0, -3, 4.0, True, "Auto", "", [8]])
def test_bad_flag_rejected_at_construction(family, bad):
    with pytest.raises(ValueError, match=r"streaming_backward_chunk.*None, \"auto\", or a positive int"):
        make_config(family, streaming_backward_chunk=bad)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_flag_saved_and_reloaded(family, tmp_path):
    make_config(family, streaming_backward_chunk=96).save_pretrained(tmp_path)
    assert transformers.AutoConfig.from_pretrained(tmp_path).streaming_backward_chunk == 96
    assert make_config(family).streaming_backward_chunk is None


def test_auto_chunk_policy():
    assert streaming_chunk_size("auto", 4096) == 4096  # hidden_size query tokens
    assert streaming_chunk_size("auto", 256) == 1024  # at least 1024 (config.py: shorter chunks cost time)
    assert streaming_chunk_size(7, 4096) == 7 and streaming_chunk_size(7, 256) == 7
    # on an accelerator at least 4096 (config.py: each chunk is host work the GPU waits for)
    assert streaming_chunk_size("auto", 256, "cuda") == 4096 and streaming_chunk_size("auto", 8192, "cuda") == 8192
    assert streaming_chunk_size(7, 256, "cuda") == 7


def test_flag_assigned_after_construction_is_checked_at_use():
    model = make_model("llama", streaming_backward_chunk=8).train()
    model.config.streaming_backward_chunk = 2.5
    with pytest.raises(ValueError, match="streaming_backward_chunk"):
        model(input_ids=torch.ones(1, 12, dtype=torch.long), labels=torch.ones(1, 12, dtype=torch.long))


# ----------------------------------------------------------------------------- exactness, fp32


@pytest.mark.parametrize(("family", "implementation"), IMPLEMENTATIONS)
@pytest.mark.parametrize("chunk", CHUNKS, ids=str)
def test_exact_against_unsplit(family, implementation, chunk):
    """Batch 3: left padding on one row, ignored labels, one row fully ignored."""
    compare_streaming(family, chunk, seed_of(family, implementation, chunk),
                      model_kwargs={"attn_implementation": implementation})


def plain_causal_inputs(seed):
    """Batch 2, no padding: the model passes no attention mask (plainly causal)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, COMMON["vocab_size"], (2, SEQ), generator=gen)
    labels = ids.clone()
    labels[0, torch.randperm(SEQ, generator=gen)[: SEQ // 4]] = -100
    return ids, None, labels


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("chunk", [1, 7, SEQ + 5, "auto"], ids=str)
@pytest.mark.parametrize("path", ["split", "views", "bias-only"])
def test_exact_plain_causal_sdpa_with_lower_right_bias(family, chunk, path, monkeypatch):
    """No attention mask (batch 2, no padding, no window): the model passes none, and each chunk gets torch's
    lower-right causal bias (no [chunk, keys] mask tensor; GQA, 4 query heads and 2 KV heads). On the CPU:
    - split (float32, the default): the bias (masks.OwnKeysCausalBias) attends to the keys before the chunk and to its
      own keys in two kernel calls; a single query's heads packed into rows (chunks of 1 under GQA) are torch's;
    - views (what half precision takes): every call after the forward's first chunk gets a view of one additive
      mask per layer call (masks.OffsetChunkMasks, built once in the forward and once in the backward);
    - bias-only (what a CUDA run does): torch's bias for every chunk, which the CPU materializes."""
    calls, built, splits = [], [], []
    monkeypatch.setattr(masks, "causal_lower_right", lambda *size: calls.append(size) or causal_lower_right(*size))
    real_masks = streamed_layer.OffsetChunkMasks
    monkeypatch.setattr(streamed_layer, "OffsetChunkMasks", lambda *args: built.append(args) or real_masks(*args))
    real_split = masks._PrefixAndOwnKeysAttention.apply
    monkeypatch.setattr(masks._PrefixAndOwnKeysAttention, "apply", lambda *args: splits.append(args[0].shape) or real_split(*args))
    if path != "split":
        monkeypatch.setattr(masks, "SPLIT_DTYPES", ())
    if path == "bias-only":
        monkeypatch.setattr(streamed_layer.StreamedCall, "views_of_one_mask", lambda self: contextlib.nullcontext())
    compare_streaming(family, chunk, 0, inputs=plain_causal_inputs(seed_of(family, "plain", chunk)),
                      model_kwargs={"attn_implementation": "sdpa"})
    step = streaming_chunk_size(chunk, COMMON["hidden_size"])
    starts = range(0, SEQ, step)
    # (queries, keys) = (chunk length, its causal prefix).
    expected = [(min(start + step, SEQ) - start, min(start + step, SEQ)) for start in starts]
    every_chunk = sorted(expected * 2 * 2)  # forward and recompute, both layers
    if path == "views":  # the forward's first chunk in both layers; one mask per layer in the forward and the backward
        assert calls == [expected[0]] * 2, calls
        assert len(built) == (2 * 2 if len(expected) > 1 else 2), built
        assert all(args[:3] == (step, SEQ, None) and args[3] == torch.float32 for args in built), built
    else:
        assert sorted(calls) == every_chunk and not built, (calls, built)
    if path == "split" and step > 1:  # every chunk with keys before it
        assert len(splits) == 2 * 2 * (len(expected) - 1), splits
    else:
        assert not splits, splits


@pytest.mark.parametrize("window", [None, 1, 3, 8, 40])
@pytest.mark.parametrize(("seq", "chunk"), [(40, 7), (40, 40), (33, 8), (9, 16)])
def test_offset_chunk_mask_views_equal_the_chunk_masks(window, seq, chunk):
    """Each chunk's view of OffsetChunkMasks allows exactly what `sdpa_mask` builds for it (causal, sliding window)."""
    if window is not None and window >= seq:
        window = None  # as StreamedCall does: such a window cuts nothing
    views = masks.OffsetChunkMasks(chunk, seq, window, torch.float32, torch.device("cpu"))
    for start in range(0, seq, chunk):
        end = min(start + chunk, seq)
        kv_start = masks.window_start(window, start)
        reference = masks.chunk_mask(None, 1, start, end, kv_start, end, window, torch.device("cpu"))
        view = views.view(end - start, end - kv_start)
        assert view.shape[-2:] == reference.shape[-2:]
        assert torch.equal(view[0, 0] == 0, reference[0, 0]), (start, end, window)
        assert bool(torch.isneginf(view[view != 0]).all())


def test_plain_causal_chunks_under_dispatch_modes(monkeypatch):
    """torch cannot create its CausalBias subclass under a TorchDispatchMode: the streamed chunk must still run
    under one (our memory tracker, as the bench uses it; FakeTensorMode)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    calls = []
    monkeypatch.setattr(masks, "causal_lower_right", lambda *size: calls.append(size) or causal_lower_right(*size))

    ids = torch.randint(1, COMMON["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(3))
    model = make_model("llama", streaming_backward_chunk=7, attn_implementation="sdpa").train()
    with LiveTensorTracker() as tracker:
        model(input_ids=ids, labels=ids).loss.backward()
    assert tracker.peak_bytes > 0
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake_ids = torch.zeros(1, SEQ, dtype=torch.long)
        model(input_ids=fake_ids, labels=fake_ids).loss.backward()
    assert calls


@pytest.mark.parametrize(("family", "implementation"), IMPLEMENTATIONS)
@pytest.mark.parametrize("block_rows", [1, 10], ids=lambda rows: f"block_rows{rows}")
def test_exact_with_row_blocks(family, implementation, block_rows, monkeypatch):
    """Row blocks of one chunk, or of two (chunk 5): the backward runs the chunk holding left-padding rows first,
    then the others from the last, and backpropagates each block's dK/dV as soon as it is final (the first
    block, whose chunk is blind, at the end). Batch 3 with left padding and ignored labels."""
    monkeypatch.setattr(rows, "BLOCK_ROWS", block_rows)
    compare_streaming(family, 5, seed_of(family, implementation, "blocks", block_rows),
                      model_kwargs={"attn_implementation": implementation})


@pytest.mark.parametrize("family", sorted(WINDOWED))
def test_exact_with_row_blocks_and_sliding_window(family, monkeypatch):
    monkeypatch.setattr(rows, "BLOCK_ROWS", 1)
    compare_streaming(family, 4, seed_of(family, "blocks-window"),
                      model_kwargs={"attn_implementation": "eager", **WINDOWED[family](6)})


def test_input_gradient_grows_as_key_value_gradients_are_freed(monkeypatch):
    """The layer's backward never holds the whole input gradient next to the whole dK/dV: with row blocks of one
    chunk the backward's peak is at least 0.75 of a [B, S, d] tensor below the one-block run (whole dK/dV until the
    end, input gradient whole from the first chunk), and the gradients are the same. MHA, so K and V are [B, S, d];
    the LM head by mini-sequences, so that the layers' backward, not the logits, makes the peak."""
    seq = 512
    ids = torch.randint(1, COMMON["vocab_size"], (2, seq), generator=torch.Generator().manual_seed(4))
    peaks, grads = {}, {}
    for block_rows in (seq, 32):
        monkeypatch.setattr(rows, "BLOCK_ROWS", block_rows)
        model = make_model("llama", streaming_backward_chunk=32, mini_sequence_chunk=32, num_key_value_heads=4,
                           attn_implementation="sdpa")
        loss = model.train()(input_ids=ids, labels=ids).loss
        with LiveTensorTracker() as tracker:
            loss.backward()
        peaks[block_rows] = tracker.peak_bytes
        grads[block_rows] = {n: p.grad for n, p in model.named_parameters()}
    for name, grad in grads[seq].items():
        assert_close(grads[32][name], grad, what=name)
    row_bytes = 2 * seq * COMMON["hidden_size"] * 4
    assert peaks[seq] - peaks[32] >= 0.75 * row_bytes, (peaks, row_bytes)


@pytest.mark.parametrize(("family", "implementation"), IMPLEMENTATIONS)
def test_exact_with_mini_sequence_and_right_padding(family, implementation):
    ids, mask, labels = batch(seed_of(family, "right"))
    mask = torch.ones_like(mask)
    mask[0, -9:] = 0  # right padding on row 0
    labels = ids.masked_fill(mask == 0, -100)
    compare_streaming(family, 6, 0, inputs=(ids, mask, labels),
                      model_kwargs={"attn_implementation": implementation, "mini_sequence_chunk": 5})


@pytest.mark.parametrize("family", sorted(WINDOWED))
@pytest.mark.parametrize("window", [4, 7, 16], ids=lambda w: f"window{w}")
def test_exact_with_sliding_window(family, window):
    """Window smaller than, equal to and larger than the chunk (7): a chunk reads keys from
    start - window + 1 only, and the mask slice must match."""
    implementation = "eager" if family == "gemma2" else ("sdpa" if window != 7 else "eager")
    compare_streaming(family, 7, seed_of(family, window),
                      model_kwargs={"attn_implementation": implementation, **WINDOWED[family](window)})


@pytest.mark.parametrize(("family", "implementation"), IMPLEMENTATIONS)
def test_exact_with_packed_sequences(family, implementation):
    """Padding-free packing (TRL): no attention mask, position_ids restart at each sequence; the
    model builds a block-diagonal causal mask, sliced per chunk."""
    gen = torch.Generator().manual_seed(seed_of(family, "packed"))
    lengths = [13, 9, 18]
    ids = torch.randint(1, COMMON["vocab_size"], (1, sum(lengths)), generator=gen)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = ids.clone()
    labels[0, torch.cumsum(torch.tensor(lengths), 0)[:-1]] = -100  # first token of each sequence
    compare_streaming(family, 5, 0, inputs=(ids, None, labels), step_kwargs={"position_ids": position_ids},
                      model_kwargs={"attn_implementation": implementation})


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_exact_with_gradient_checkpointing_replaced(family, monkeypatch):
    """With gradient checkpointing also on, streaming replaces it: exact, and no layer is checkpointed."""
    checkpointed = []

    def prepare(model):
        model.activation_checkpointing_enable()
        for layer in model.model.layers:
            inner = layer._gradient_checkpointing_func
            layer._gradient_checkpointing_func = lambda *a, _f=inner, **k: checkpointed.append(1) or _f(*a, **k)
        return model

    compare_streaming(family, 7, seed_of(family, "gc"), prepare=prepare)
    # The flag-off model (first) checkpointed each of its 2 layers once; the streamed one none.
    assert len(checkpointed) == COMMON["num_hidden_layers"]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_wrapper_path_exact(family, monkeypatch):
    """The nested-checkpoint path that wrapped layers (ZeRO-3, FSDP) take, forced in one process."""
    monkeypatch.setattr(streamed_layer, "layer_parameters", lambda layer: None)
    compare_streaming(family, 7, seed_of(family, "wrapped"), model_kwargs={"mini_sequence_chunk": 6})


def keep_offloaded_inputs_in(model, storage):
    """The layers whose checkpointing was enabled with offload=True keep their inputs in `storage` (the extension
    point of streaming_backward/offload.py: the checkpointing function's `offload` tag may be a storage)."""
    for layer in model.modules():
        function = getattr(layer, "_gradient_checkpointing_func", None)
        if getattr(layer, "gradient_checkpointing", False) and getattr(function, "offload", False):
            function.offload = storage
    return model


class RecordingHostStorage(offload.HostStorage):
    """The library's host storage, recording what it saves and which rows it brings back."""

    def __init__(self):
        self.saved, self.loads = [], []

    def save(self, x):
        self.saved.append(tuple(x.shape))
        return super().save(x)

    def load(self, saved, start, end, device):
        self.loads.append((start, end))
        return super().load(saved, start, end, device)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_offloaded_input_read_back_by_chunks(family):
    """activation_checkpointing_enable(offload=True) with streaming: each streamed layer keeps its input on the
    host (one save per layer and step, not the accelerator tensor) and its backward reads it back one chunk at a
    time; exact against upstream's checkpointing on a padded batch. (Upstream's own offload=True cannot be the
    reference here: on a machine without an accelerator it asks for pinned memory and fails.)"""
    storage = RecordingHostStorage()

    def prepare(model):
        model.activation_checkpointing_enable(offload=model.config.streaming_backward_chunk is not None)
        return keep_offloaded_inputs_in(model, storage)

    compare_streaming(family, 7, seed_of(family, "offload"), prepare=prepare, model_kwargs={"mini_sequence_chunk": 6})
    ids = batch(seed_of(family, "offload"))[0]
    assert storage.saved == [tuple(ids.shape) + (COMMON["hidden_size"],)] * COMMON["num_hidden_layers"]
    # Per layer: the backward's K/V pass (in order), then each chunk's recompute (the first chunk, whose left-padding
    # rows see no key, twice: its output, then its own K/V): never more than one chunk at once.
    chunks = [(start, min(start + 7, ids.shape[1])) for start in range(0, ids.shape[1], 7)]
    assert sorted(storage.loads) == sorted((chunks * 2 + chunks[:1]) * COMMON["num_hidden_layers"])
    assert storage.loads[: len(chunks)] == chunks


def test_offload_follows_the_checkpointed_layers():
    """Only layers whose checkpointing was enabled with offload=True offload (every_n_layers=2: the first);
    without offload, or without checkpointing, the input stays where it is."""
    for enable, expected in ((dict(offload=True, every_n_layers=2), 1), (dict(offload=False), 0), (None, 0)):
        storage = RecordingHostStorage()
        model = make_model("llama", streaming_backward_chunk=7)
        if enable is not None:
            model.activation_checkpointing_enable(**enable)
        train_step(keep_offloaded_inputs_in(model, storage), *batch(seed_of("every_n", expected)))
        assert len(storage.saved) == expected, enable


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_wrapper_path_with_offload_exact(family, monkeypatch):
    """The nested-checkpoint path (ZeRO-3, FSDP1) with offload=True saves through torch's save_on_cpu, as
    upstream's offloaded checkpointing does; exact."""
    entered = []
    save_on_cpu = torch.autograd.graph.save_on_cpu

    def recording_save_on_cpu(*args, **kwargs):
        entered.append(kwargs)
        return save_on_cpu(*args, **kwargs)

    monkeypatch.setattr(streamed_layer, "layer_parameters", lambda layer: None)
    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", recording_save_on_cpu)

    def prepare(model):  # (the flag-off reference without offload: see above)
        model.activation_checkpointing_enable(offload=model.config.streaming_backward_chunk is not None)
        return model

    compare_streaming(family, 7, seed_of(family, "wrapped-offload"), prepare=prepare)
    assert [e["pin_memory"] for e in entered] == [False] * COMMON["num_hidden_layers"]  # CPU tensors: not pinned


@pytest.mark.parametrize("block_rows", [1, rows.BLOCK_ROWS], ids=lambda rows: f"block_rows{rows}")
def test_attention_dropout_replayed(block_rows, monkeypatch):
    """With attention dropout the streamed backward must replay the forward's draws: the Function path
    (which recomputes the chunks in another order, each from its own recorded RNG state) gives the same loss and
    gradients as plain autograd through the same chunks (the wrapper path, where torch's checkpoint replays the
    RNG), and differs from the dropout-free run."""
    monkeypatch.setattr(rows, "BLOCK_ROWS", block_rows)
    inputs = batch(31)
    runs = {}
    for name in ("function", "autograd", "no-dropout"):
        model = make_model("qwen2", streaming_backward_chunk=7,
                           attention_dropout=0.0 if name == "no-dropout" else 0.3)
        with monkeypatch.context() as patch:
            if name == "autograd":
                patch.setattr(streamed_layer, "layer_parameters", lambda layer: None)
            torch.manual_seed(5)
            runs[name] = train_step(model, *inputs)
    (out, grads, embeds), (ref, ref_grads, ref_embeds) = runs["function"], runs["autograd"]
    assert_close(out.loss, ref.loss, what="loss")
    for name in ref_grads:
        assert_close(grads[name], ref_grads[name], what=name)
    assert_close(embeds, ref_embeds, what="inputs_embeds")
    plain = runs["no-dropout"][1]
    moved = max(((grads[n] - plain[n]).norm() / plain[n].norm()).item() for n in plain)
    assert moved > 0.05, f"dropout changed the gradients by only {moved:.2e}: is it applied?"


# ----------------------------------------------------------------------------- bf16


def assert_bf16_as_accurate_as_upstream(family, **flags):
    """bf16 with `flags` is as accurate as upstream bf16, both against fp32 from the same bf16 weights and
    inputs (relative-norm error of all gradients and of the loss). Shared with test_adjoint_sharding.py."""
    inputs = batch(14, seq=96)
    model16 = make_model(family).to(torch.bfloat16)
    model32 = make_model(family)
    model32.load_state_dict({k: v.float() for k, v in model16.state_dict().items()})
    ref_out, ref_grads, ref_embeds = train_step(model32, *inputs)
    reference = torch.cat([g.double().flatten() for g in [*ref_grads.values(), ref_embeds]])
    errors = []
    for model_flags in ({}, flags):
        out, grads, embeds = train_step(make_model(family, **model_flags).to(torch.bfloat16), *inputs)
        flat = torch.cat([g.double().flatten() for g in [*grads.values(), embeds]])
        errors.append((((flat - reference).norm() / reference.norm()).item(), abs(out.loss.item() - ref_out.loss.item())))
    (grad_up, loss_up), (grad_ours, loss_ours) = errors
    assert grad_ours <= 1.25 * grad_up, f"gradient error {grad_ours:.2e} vs upstream bf16 {grad_up:.2e}"
    assert loss_ours <= 1.5 * loss_up + 1e-3, f"loss error {loss_ours:.2e} vs upstream bf16 {loss_up:.2e}"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bf16_as_accurate_as_upstream(family):
    assert_bf16_as_accurate_as_upstream(family, streaming_backward_chunk=9)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mixtral"])
def test_cpu_autocast_plain_causal_as_accurate_as_upstream(family):
    """fp32 weights under bf16 autocast (HF Trainer's `bf16=True` on the CPU), no attention mask (each chunk gets
    torch's lower-right causal bias): autocast casts SDPA's inputs, which differ there (fp32 queries and keys after the
    rotary embedding, bf16 values), and the bias's path calls kernels autocast does not cast (masks.OwnKeysCausalBias
    casts them). Until mst.21 this raised a dtype error. As accurate as upstream under autocast, against fp32."""
    inputs = plain_causal_inputs(seed_of(family, "autocast"))
    ref_out, ref_grads, ref_embeds = train_step(make_model(family, attn_implementation="sdpa"), *inputs)
    reference = torch.cat([g.double().flatten() for g in [*ref_grads.values(), ref_embeds]])
    errors = []
    for chunk in (None, 9):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, grads, embeds = train_step(
                make_model(family, attn_implementation="sdpa", streaming_backward_chunk=chunk), *inputs)
        flat = torch.cat([g.double().flatten() for g in [*grads.values(), embeds]])
        errors.append((((flat - reference).norm() / reference.norm()).item(), abs(out.loss.item() - ref_out.loss.item())))
    (grad_up, loss_up), (grad_ours, loss_ours) = errors
    assert grad_up > 1e-4  # autocast really computed in bf16
    assert grad_ours <= 1.25 * grad_up, f"gradient error {grad_ours:.2e} vs upstream autocast {grad_up:.2e}"
    assert loss_ours <= 1.5 * loss_up + 1e-3, f"loss error {loss_ours:.2e} vs upstream autocast {loss_up:.2e}"


def test_bf16_linear_weights_one_fp32_out_gemm_per_chunk(monkeypatch):
    """With a GEMM that writes fp32 (CUDA; stood in for here), each recomputed chunk's gradient of each bf16 linear
    weight is one such GEMM into the fp32 sum, as accurate as upstream bf16."""
    from test_mini_sequence_core import fp32_out_addmm_stand_in

    calls = fp32_out_addmm_stand_in(monkeypatch)
    assert_bf16_as_accurate_as_upstream("llama", streaming_backward_chunk=9)
    # 96 tokens in 11 chunks of 9 (batch 3: 27 rows), 2 layers: q/k/v/o/gate/up/down per chunk; upstream's run makes
    # no such call.
    assert len(calls) == 2 * 11 * 7 and all(dtype == torch.bfloat16 for _, dtype in calls), len(calls)
    assert sorted({rows for (_, rows), _ in calls}) == [18, 27]


# ----------------------------------------------------------------------------- unchanged paths


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_eval_and_generate_unchanged(family):
    ids, mask, labels = batch(10)
    ref = make_model(family).eval()(input_ids=ids, attention_mask=mask, labels=labels)
    out = make_model(family, streaming_backward_chunk=3).eval()(input_ids=ids, attention_mask=mask, labels=labels)
    assert torch.equal(out.logits, ref.logits) and torch.equal(out.loss, ref.loss)
    prompt = ids[:1, :9]
    generated = [make_model(family, streaming_backward_chunk=c).generate(prompt, max_new_tokens=5, do_sample=False)
                 for c in (None, 3)]
    assert torch.equal(*generated)


def test_no_grad_training_mode_runs_upstream(monkeypatch):
    # Imported here: transformers' lazy module has no such attribute until some test imported the package.
    streaming_backward = importlib.import_module("transformers.streaming_backward")
    monkeypatch.setattr(streaming_backward, "decoder_layer_forward", lambda *a, **k: pytest.fail("streamed under no_grad"))
    model = make_model("llama", streaming_backward_chunk=3).train()
    with torch.no_grad():
        model(input_ids=torch.ones(1, 12, dtype=torch.long))


@pytest.mark.parametrize("checkpointing", [False, True])
def test_no_grad_training_forward_fills_its_cache_as_upstream(checkpointing):
    """Upstream 5.24: without gradients nothing is checkpointed and the layers fill the cache, even in training
    mode (e.g. generating from a model being trained). Streaming applies exactly where a backward follows."""
    ids = batch(11)[0]
    outputs = []
    for value in (None, 3):
        model = make_model("llama", streaming_backward_chunk=value).train()
        if checkpointing:
            model.activation_checkpointing_enable()
        with torch.no_grad():
            outputs.append(model(input_ids=ids, use_cache=True))
    ref, out = outputs
    assert ref.cache is not None and ref.cache.get_seq_length() == ids.shape[1]
    assert out.cache.get_seq_length() == ids.shape[1]
    assert torch.equal(out.logits, ref.logits)


# ----------------------------------------------------------------------------- errors


# ----------------------------------------------------------------------------- flash_attention_2 (CPU stand-in)
# flash-attn needs a GPU. On CPU its two kernels are replaced by a torch reference of their documented semantics
# (flash-attn >= 2.1): per sequence, causal masking aligned bottom-right (query i of nq sees key j of nk iff
# j <= i + nk - nq), a (left, right) window around that diagonal, soft-capped logits, GQA by head groups. Upstream's
# own FlashAttention glue (unpadding, varlen packing, kwargs) runs unchanged around it, for the unsplit reference
# and for the streamed chunks alike. What this cannot show is that the real kernels match their documentation.


def reference_flash_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, deterministic=False):
    assert dropout_p == 0.0
    out = q.new_zeros(q.shape)
    groups = q.shape[1] // k.shape[1]
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for (q0, q1), (k0, k1) in zip(zip(bounds_q, bounds_q[1:]), zip(bounds_k, bounds_k[1:])):
        assert q1 > q0 and k1 > k0, "empty varlen segment sent to the kernel"
        assert q1 - q0 <= max_seqlen_q and k1 - k0 <= max_seqlen_k
        queries = q[q0:q1].transpose(0, 1)
        keys = k[k0:k1].transpose(0, 1).repeat_interleave(groups, 0)
        values = v[k0:k1].transpose(0, 1).repeat_interleave(groups, 0)
        scores = queries @ keys.transpose(-1, -2) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        diagonal = torch.arange(q1 - q0)[:, None] + (k1 - k0) - (q1 - q0)
        key_index = torch.arange(k1 - k0)[None]
        allowed = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool)
        if causal:
            allowed &= key_index <= diagonal
        if window_size[0] >= 0:
            allowed &= key_index >= diagonal - window_size[0]
        if window_size[1] >= 0:
            allowed &= key_index <= diagonal + window_size[1]
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        out[q0:q1] = (probs @ values).transpose(0, 1)
    return out


def reference_flash(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    deterministic=False):
    batch, q_len, k_len = q.shape[0], q.shape[1], k.shape[1]
    out = reference_flash_varlen(
        q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), torch.arange(batch + 1) * q_len,
        torch.arange(batch + 1) * k_len, q_len, k_len, dropout_p, softmax_scale, causal, window_size, softcap)
    return out.view(q.shape)


@pytest.fixture
def flash_reference(monkeypatch):
    """Upstream's flash_attention_2 path with the reference kernels; returns `prepare` for compare_streaming
    (the model is built with sdpa, as flash-attn is not installed, then switched to flash_attention_2)."""
    from transformers import modeling_flash_attention_utils as fa

    calls = []

    def counted(function):
        return lambda *args, **kwargs: calls.append(function.__name__) or function(*args, **kwargs)

    kernels = (counted(reference_flash), counted(reference_flash_varlen), None, fa._pad_input, fa._unpad_input)
    processing = (fa._lazy_define_process_function(reference_flash_varlen), dict)
    monkeypatch.setattr(fa, "lazy_import_flash_attention", lambda *args, **kwargs: (kernels, processing))

    def prepare(model):
        model.config._attn_implementation = "flash_attention_2"
        return model

    prepare.calls = calls
    return prepare


FLASH_FAMILIES = sorted(FAMILIES)  # Gemma-2 too: FlashAttention soft-caps its logits


def test_flash_reference_is_not_sdpa(flash_reference):
    """The stand-in really runs (and so the comparisons below are of the flash_attention_2 path)."""
    model = flash_reference(make_model("llama"))
    ids, mask, labels = batch(1)
    train_step(model, ids, mask, labels)
    assert "reference_flash_varlen" in flash_reference.calls


@pytest.mark.parametrize("family", FLASH_FAMILIES)
@pytest.mark.parametrize("chunk", [1, 7, SEQ + 5, "auto"], ids=str)
def test_exact_flash_attention_padded(family, chunk, flash_reference):
    """Batch 3, left padding on one row (whole chunks of it padding: that row is left out of those chunks' calls,
    which must never send an empty query segment), ignored labels; GQA."""
    compare_streaming(family, chunk, seed_of(family, "flash", chunk), prepare=flash_reference)


@pytest.mark.parametrize("family", FLASH_FAMILIES)
def test_exact_flash_attention_unpadded_and_right_padded(family, flash_reference):
    ids, mask, labels = batch(seed_of(family, "flash-right"))
    compare_streaming(family, 6, 0, inputs=(ids, None, labels), prepare=flash_reference)  # no mask at all
    mask = torch.ones_like(mask)
    mask[0, -9:] = 0
    compare_streaming(family, 6, 0, inputs=(ids, mask, ids.masked_fill(mask == 0, -100)), prepare=flash_reference,
                      model_kwargs={"mini_sequence_chunk": 5})


@pytest.mark.parametrize("family", sorted(WINDOWED))
@pytest.mark.parametrize("window", [4, 7, 16], ids=lambda w: f"window{w}")
def test_exact_flash_attention_sliding_window(family, window, flash_reference):
    """Window smaller than, equal to and larger than the chunk: with left padding, with a hole in a row's mask as
    well (upstream's window counts unpadded tokens, so a padded chunk reads from key 0), and without a mask (the
    chunk reads keys from start - window + 1)."""
    ids, mask, labels = batch(seed_of(family, "flash-window", window))
    holed = mask.clone()
    holed[0, 12:15] = 0
    for inputs in ((ids, mask, labels), (ids, holed, labels.masked_fill(holed == 0, -100)), (ids, None, labels)):
        compare_streaming(family, 7, 0, inputs=inputs, prepare=flash_reference, model_kwargs=WINDOWED[family](window))


@pytest.mark.parametrize("family", FLASH_FAMILIES)
@pytest.mark.parametrize("how", ["position_ids", "cu_seq_lens"])
def test_exact_flash_attention_packed(family, how, flash_reference):
    """Padding-free packing, as TRL and DataCollatorWithFlattening give it: position_ids that restart, or
    FlashAttention's own cu_seq_lens/max_length kwargs. Chunk 5 against sequences of 13, 9 and 18 tokens: chunks
    that start inside a sequence, hold a whole one, or span two; with a window of 4 for the windowed families."""
    lengths = [13, 9, 18]
    gen = torch.Generator().manual_seed(seed_of(family, "flash-packed"))
    ids = torch.randint(1, COMMON["vocab_size"], (1, sum(lengths)), generator=gen)
    labels = ids.clone()
    labels[0, torch.cumsum(torch.tensor(lengths), 0)[:-1]] = -100
    step_kwargs = {"position_ids": torch.cat([torch.arange(n) for n in lengths])[None]}
    if how == "cu_seq_lens":
        cu = torch.tensor([0, *torch.cumsum(torch.tensor(lengths), 0).tolist()], dtype=torch.int32)
        step_kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths), max_length_k=max(lengths))
    model_kwargs = WINDOWED[family](4) if family in WINDOWED else {}
    compare_streaming(family, 5, 0, inputs=(ids, None, labels), step_kwargs=step_kwargs, prepare=flash_reference,
                      model_kwargs=model_kwargs)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_exact_flash_attention_wrapper_path(family, flash_reference, monkeypatch):
    """The nested-checkpoint path (ZeRO-3, FSDP1) with flash_attention_2, padded batch."""
    monkeypatch.setattr(streamed_layer, "layer_parameters", lambda layer: None)
    compare_streaming(family, 7, seed_of(family, "flash-wrapped"), prepare=flash_reference,
                      model_kwargs={"mini_sequence_chunk": 6})


def test_flash_attention_with_top_left_causal_mask_refused(flash_reference, monkeypatch):
    """flash-attn < 2.1 aligns the causal mask top-left: every chunk after the first would be wrong."""
    from transformers import modeling_flash_attention_utils as fa

    monkeypatch.setattr(fa, "flash_attn_supports_top_left_mask", lambda: True)
    model = flash_reference(make_model("llama", streaming_backward_chunk=4))
    ids = torch.ones(1, 12, dtype=torch.long)
    with pytest.raises(ValueError, match=r"flash-attn aligns its causal mask top-left.*>= 2\.1"):
        model.train()(input_ids=ids, labels=ids)


def test_unsupported_attention_implementation_raises_at_first_training_forward():
    def plain_attention(module, query, key, value, attention_mask, **kwargs):
        return transformers.integrations.sdpa_attention.sdpa_attention_forward(
            module, query, key, value, attention_mask, **kwargs)

    transformers.AttentionInterface.register("mst_test_attention", plain_attention)
    model = make_model("llama", streaming_backward_chunk=4, attn_implementation="mst_test_attention")
    ids = torch.ones(1, 12, dtype=torch.long)
    model.eval()(input_ids=ids)  # eval: upstream path, fine
    with pytest.raises(ValueError, match=r"attn_implementation='mst_test_attention'.*\('sdpa', 'eager', 'flash_attention_2'\)"):
        model.train()(input_ids=ids, labels=ids)


@pytest.mark.parametrize("chunk", [1, 4, 5], ids=str)
def test_non_causal_mask_exact(chunk):
    """A 4D mask that lets a query see later keys (a bidirectional prefix of 6, prefix-LM style): the chunks holding
    such queries read every key (blind chunks, masks.plan_key_ranges), exact against the unsplit layer."""
    seq = 12
    mask = torch.tril(torch.ones(seq, seq, dtype=torch.bool))
    mask[:6, :6] = True
    additive = torch.zeros(2, 1, seq, seq).masked_fill(~mask, torch.finfo(torch.float32).min)
    ids = torch.randint(1, 100, (2, seq), generator=torch.Generator().manual_seed(chunk))
    from test_streaming_families import assert_same_training

    models = [make_model("llama", streaming_backward_chunk=value, attn_implementation="eager") for value in (None, chunk)]
    assert_same_training(models[1], *(train_step(model, ids, additive, ids) for model in models))


def test_bidirectional_gemma2_raises():
    model = make_model("gemma2", streaming_backward_chunk=4, use_bidirectional_attention=True).train()
    ids = torch.ones(1, 12, dtype=torch.long)
    with pytest.raises(ValueError, match="needs causal attention"):
        model(input_ids=ids, labels=ids)


def test_output_attentions_in_training_raises():
    model = make_model("llama", streaming_backward_chunk=4, attn_implementation="eager").train()
    ids = torch.ones(1, 12, dtype=torch.long)
    with pytest.raises(ValueError, match="output_attentions=True is not supported"):
        model(input_ids=ids, labels=ids, output_attentions=True)


def test_missing_gradient_raises(monkeypatch):
    """A parameter used by the layer but not handed to the Function must raise, not lose its gradient."""
    real = streamed_layer.layer_parameters
    monkeypatch.setattr(streamed_layer, "layer_parameters", lambda layer: real(layer)[1:])
    model = make_model("llama", streaming_backward_chunk=4).train()
    ids = torch.ones(1, 12, dtype=torch.long)
    with pytest.raises(RuntimeError, match="not among the parameters the chunked Function was given"):
        model(input_ids=ids, labels=ids).loss.backward()


# ----------------------------------------------------------------------------- memory


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_no_full_sequence_scores_queries_or_attention_output(family):
    """With streaming, no [B, heads, S, S] scores and no full-sequence Q or attention output is ever
    allocated (forward or backward). Shapes chosen so these are recognisable: 4 query heads of 12
    (q width 48), 2 KV heads (K/V width 24), hidden 32, S = 256 (no other dimension is 256)."""
    seq, heads, head_dim = 256, 4, 12
    ids = torch.randint(1, COMMON["vocab_size"], (2, seq), generator=torch.Generator().manual_seed(1))
    found = {}
    for chunk in (None, 32):
        model = make_model(family, streaming_backward_chunk=chunk, attn_implementation="eager", head_dim=head_dim).train()
        with LiveTensorTracker(keep_largest=5_000) as tracker:
            model(input_ids=ids, labels=ids).loss.backward()
        found[chunk] = [
            shape for _, shape, _ in tracker.largest_shapes
            # Per-head scores / probabilities. (The model's own [B, 1, S, S] masks are upstream's, built once
            # per forward before the layers, and shared by them.)
            if (len(shape) == 4 and shape[1] != 1 and shape[-2:] == (seq, seq))
            # Full q_proj output (the first full-Q tensor) or attention output. (A [B, heads, S, head_dim]
            # shape is not checked: eager's repeat_kv legitimately expands the last chunk's K/V prefix to it.)
            or shape[-2:] == (seq, heads * head_dim)
        ]
    assert found[None], "the tracker must see upstream's full-sequence attention tensors"
    assert found[32] == [], found[32][:5]

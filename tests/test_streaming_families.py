"""The streamed decoder layer (streaming_backward/: the layer's own forward per query chunk, its K/V met at the
`Cache` seam) against the unsplit layer, on every streamed family (tests/test_streaming.py has more on the first
four). fp32 tiny configs: loss and every gradient within 1e-5."""

import zlib

import pytest
import torch
import transformers
from test_mini_sequence_models import assert_close, tokens_per_projection, train_step
from tiny_models import COMMON, FAMILIES, NEW_FAMILIES, NO_AUX_LOSS, make_model
from transformers.streaming_backward import layer as generic
from transformers.streaming_backward import rows


SEQ = 24
CHUNKS = [1, 7, SEQ - 1, SEQ + 5]
# The newer streamed families, with tests/tiny_models.py's tiny configs (GPT-OSS: alternating windows, sinks).
GENERIC_FAMILIES = {f: NEW_FAMILIES[f] for f in ("qwen3", "phi3", "olmo2", "gemma3_text", "mixtral", "qwen3_moe", "gpt_oss",
                                                 "olmo3", "smollm3", "ministral3", "olmoe", "deepseek_v2",
                                                 "deepseek_v3", "glm4_moe", "glm4_moe_lite", "llama4_text",
                                                 "gemma4_text", "granite", "granitemoe", "granitemoeshared")}
# Upstream has no SDPA path for these (Gemma-2: soft-capped attention; GPT-OSS: sinks), and GPT-OSS's
# FlashAttention needs a kernel with sinks (flash-attn has none): eager only.
EAGER_ONLY = {"gemma2", "gpt_oss"}


def seed_of(*parts):
    return zlib.crc32("/".join(map(str, parts)).encode()) % 1000


def padded_batch(seed, seq=SEQ):
    """Batch 2: row 1 left-padded by 6 tokens, a quarter of row 0's labels ignored."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, COMMON["vocab_size"], (2, seq), generator=gen)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :6] = 0
    labels = input_ids.clone()
    labels[attention_mask == 0] = -100
    labels[0, torch.randperm(seq, generator=gen)[: seq // 4]] = -100
    return input_ids, attention_mask, labels


def build(family, seed=0, **overrides):
    torch.manual_seed(seed)
    if family in FAMILIES:
        return make_model(family, seed, **overrides)
    config_name, model_name, extra = GENERIC_FAMILIES[family]
    fields = {name: overrides.pop(name) for name in ("streaming_backward_chunk",) if name in overrides}
    config = getattr(transformers, config_name)(**{**COMMON, **extra, **overrides})
    for name, value in fields.items():
        setattr(config, name, value)
    return getattr(transformers, model_name)(config)


def compare(family, chunk, inputs, monkeypatch, prepare=None, step_kwargs=None, **model_kwargs):
    """Flag off vs streamed by the generic layer: same loss, every gradient, and no parameter without one.
    `prepare(model)` runs on both models (e.g. the flash_attention_2 stand-in); `step_kwargs` go to the model."""
    calls = []
    real = generic.StreamedLayerFunction.apply
    monkeypatch.setattr(generic.StreamedLayerFunction, "apply", lambda *args: calls.append(1) or real(*args))
    results = []
    for value in (None, chunk):
        model = build(family, streaming_backward_chunk=value, **model_kwargs)
        if prepare is not None:
            model = prepare(model)
        results.append(train_step(model, *inputs, **(step_kwargs or {})))
    assert len(calls) == model.config.num_hidden_layers, "the generic streamed layer did not run"
    assert_same_training(model, *results)


def assert_same_training(model, reference, result):
    """Same loss, every gradient, and no parameter without one (`train_step`'s results)."""
    (ref, ref_grads, ref_embeds), (out, grads, embeds) = reference, result
    assert_close(out.loss, ref.loss, what="loss")
    # Every parameter but the input embeddings (train_step feeds inputs_embeds) has a gradient.
    embedding = model.get_input_embeddings().weight
    names = {name for name, p in model.named_parameters() if p.requires_grad and p is not embedding}
    assert grads.keys() == ref_grads.keys() and names <= grads.keys(), names - grads.keys()
    for name in ref_grads:
        assert_close(grads[name], ref_grads[name], what=name)
    assert_close(embeds, ref_embeds, what="inputs_embeds")


ALL = sorted(GENERIC_FAMILIES) + sorted(FAMILIES)


# Gemma-2 has no SDPA path upstream (soft-capped attention): eager only.
IMPLEMENTATIONS = [(f, i) for f in ALL for i in ("sdpa", "eager") if not (f in EAGER_ONLY and i == "sdpa")]


@pytest.mark.parametrize(("family", "implementation"), IMPLEMENTATIONS)
@pytest.mark.parametrize("chunk", CHUNKS, ids=str)
def test_exact_left_padding_and_ignored_labels(family, implementation, chunk, monkeypatch):
    """Batch 2: left padding on one row (a chunk holding a row that sees no key reads every key), ignored labels."""
    compare(family, chunk, padded_batch(seed_of(family, implementation, chunk)), monkeypatch,
            attn_implementation=implementation)


@pytest.mark.parametrize("family", sorted(GENERIC_FAMILIES))
def test_exact_with_mini_sequence_chunk_too(family, monkeypatch):
    """Both flags, as users set them, against neither: the MLP or MoE block by mini-sequences of 4 tokens inside each
    11-token streamed chunk's forward and inside its recompute in the streamed backward."""
    calls = []
    real = generic.StreamedLayerFunction.apply
    monkeypatch.setattr(generic.StreamedLayerFunction, "apply", lambda *args: calls.append(1) or real(*args))
    inputs = padded_batch(seed_of(family, "both flags"))
    reference = train_step(build(family), *inputs)
    model = build(family, streaming_backward_chunk=11, mini_sequence_chunk=4)
    result = train_step(model, *inputs)
    assert len(calls) == model.config.num_hidden_layers, "the generic streamed layer did not run"
    assert_same_training(model, reference, result)


def plain_batch(seed, seq=SEQ):
    """Batch 2, no padding: the model passes no mask to SDPA (plainly causal); each chunk gets a bottom-right one."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, COMMON["vocab_size"], (2, seq), generator=gen)
    labels = ids.clone()
    labels[0, torch.randperm(seq, generator=gen)[: seq // 4]] = -100
    return ids, None, labels


@pytest.mark.parametrize("family", ["qwen3", "phi3", "llama", "mixtral", "deepseek_v3", "glm4_moe_lite",
                                    "llama4_text"])
@pytest.mark.parametrize("chunk", [5, SEQ + 5], ids=str)
def test_exact_plain_causal_sdpa(family, chunk, monkeypatch):
    """No mask: torch's lower-right causal bias per chunk (masks.py), which float32 CPU chunks split into two calls of
    torch's CPU flash kernel; latent attention (DeepSeek-V3, GLM-4.7-Flash: values of another head size, which that
    kernel refuses) takes torch's own bias path. Llama-4's chunked-attention layer gets upstream's chunked mask (never
    None), sliced per chunk, and its NoPE layer numbers its queries from the cache (`tokens_before`)."""
    compare(family, chunk, plain_batch(seed_of(family, "plain", chunk)), monkeypatch, attn_implementation="sdpa")


WINDOWED = {  # config overrides that give every (or every other) layer a sliding window
    "mistral": lambda w: {"sliding_window": w},
    "qwen2": lambda w: {"use_sliding_window": True, "sliding_window": w, "max_window_layers": 0},
    "gemma2": lambda w: {"sliding_window": w},
    "gemma3_text": lambda w: {"sliding_window": w, "layer_types": ["sliding_attention", "full_attention"]},
    "gemma4_text": lambda w: {"sliding_window": w},  # its tiny config: a sliding and a full-attention layer
    "qwen3": lambda w: {"use_sliding_window": True, "sliding_window": w, "max_window_layers": 0},
    "phi3": lambda w: {"sliding_window": w},
}


@pytest.mark.parametrize("family", sorted(WINDOWED))
@pytest.mark.parametrize("window", [4, 16], ids=lambda w: f"window{w}")
def test_exact_sliding_window(family, window, monkeypatch):
    """Window smaller and larger than the chunk (7): a chunk reads keys from start - window + 1 only."""
    implementation = "eager" if family == "gemma2" else "sdpa"
    for inputs in (padded_batch(seed_of(family, window)), plain_batch(seed_of(family, window))):
        compare(family, 7, inputs, monkeypatch, attn_implementation=implementation, **WINDOWED[family](window))


@pytest.mark.parametrize("family", ["qwen3", "phi3", "olmo2", "qwen3_moe", "gemma2", "llama"])
def test_exact_packed_sequences(family, monkeypatch):
    """Padding-free packing: no mask, position_ids restart per sequence; the model's block-diagonal mask is sliced."""
    gen = torch.Generator().manual_seed(seed_of(family, "packed"))
    lengths = [9, 5, 10]
    ids = torch.randint(1, COMMON["vocab_size"], (1, sum(lengths)), generator=gen)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = ids.clone()
    labels[0, torch.cumsum(torch.tensor(lengths), 0)[:-1]] = -100
    implementation = "eager" if family == "gemma2" else "sdpa"
    results = []
    for value in (None, 4):
        model = build(family, streaming_backward_chunk=value, attn_implementation=implementation)
        results.append(train_step(model, ids, None, labels, position_ids=position_ids))
    (ref, ref_grads, ref_embeds), (out, grads, embeds) = results
    assert_close(out.loss, ref.loss, what="loss")
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        assert_close(grads[name], ref_grads[name], what=name)
    assert_close(embeds, ref_embeds, what="inputs_embeds")


@pytest.mark.parametrize("family", ["llama", "qwen3", "phi3", "gemma2"])
def test_each_projection_sees_each_token_twice(family, monkeypatch):
    """8 chunks, no padding: every projection sees each token twice (forward and one recompute; k/v: forward and
    the backward's K/V pass, whose outputs the recompute gets back), as under checkpointing."""
    inputs = plain_batch(seed_of(family, "count"), seq=32)
    implementation = "eager" if family == "gemma2" else "sdpa"
    counts = tokens_per_projection(build(family, streaming_backward_chunk=4, attn_implementation=implementation),
                                   inputs, monkeypatch)
    assert counts and set(counts.values()) == {2.0}, counts
    checkpointed = build(family, attn_implementation=implementation)
    checkpointed.gradient_checkpointing_enable()
    assert tokens_per_projection(checkpointed, inputs, monkeypatch) == counts


@pytest.mark.parametrize("family", ["llama", "gemma2", "mixtral"])
def test_mini_sequence_mlp_unsplit_inside_a_streamed_chunk(family, monkeypatch):
    """Both flags, streamed chunks (8) longer than the MLP's mini-sequences (3): inside a chunk the MLP (Gemma-2: with
    its post-feedforward norm; Mixtral: the MoE block) runs unsplit, so it sees each token twice a step, not three
    times (a mini-sequence Function in the chunk's recompute would recompute it once more); exact."""
    inputs = plain_batch(seed_of(family, "inside"), seq=32)
    implementation = "eager" if family == "gemma2" else "sdpa"
    counts = tokens_per_projection(
        build(family, streaming_backward_chunk=8, mini_sequence_chunk=3, attn_implementation=implementation),
        inputs, monkeypatch,
    )
    assert counts and set(counts.values()) == {2.0}, counts
    compare(family, 8, padded_batch(seed_of(family, "inside-exact")), monkeypatch, attn_implementation=implementation,
            mini_sequence_chunk=3)


def test_recomputed_keys_values_exact_and_counted(monkeypatch):
    """Every projection sees 2 passes, as under checkpointing: the backward's K/V pass skips q_proj
    (cache.queries_not_computed) and records k_proj/v_proj's (or a fused qkv_proj's) outputs, which each chunk's
    recompute gets back (projections.py). Exact with left padding (blind chunks: K/V-only passes in the forward too,
    their recorded outputs read twice in the backward), and with nothing recorded. Without the recording the k/v
    counts are 3."""
    compare("qwen3", 5, padded_batch(seed_of("recompute")), monkeypatch, attn_implementation="sdpa")
    counts = tokens_per_projection(build("qwen3", streaming_backward_chunk=4), plain_batch(3, seq=32), monkeypatch)
    assert counts == {"self_attn.q_proj": 2.0, "self_attn.k_proj": 2.0, "self_attn.v_proj": 2.0,
                      "self_attn.o_proj": 2.0, "mlp.gate_proj": 2.0, "mlp.up_proj": 2.0, "mlp.down_proj": 2.0}
    counts = tokens_per_projection(build("phi3", streaming_backward_chunk=4), plain_batch(4, seq=32), monkeypatch)
    assert counts == {"self_attn.qkv_proj": 2.0, "self_attn.o_proj": 2.0, "mlp.gate_up_proj": 2.0,
                      "mlp.down_proj": 2.0}
    # With nothing recorded, the recompute computes them again.
    monkeypatch.setattr(generic, "recordable_projections", lambda attn, skipped=None: [])
    counts = tokens_per_projection(build("qwen3", streaming_backward_chunk=4), plain_batch(3, seq=32), monkeypatch)
    assert counts["self_attn.k_proj"] == counts["self_attn.v_proj"] == 3.0
    compare("qwen3", 5, padded_batch(seed_of("unrecorded")), monkeypatch, attn_implementation="sdpa")


def test_lora_projections_with_dropout_see_each_token_twice(monkeypatch):
    """PEFT LoRA (dropout 0.3) on q/k/v: the K/V pass cannot skip q_proj (its dropout draws before k/v's), so it runs
    q, k and v; the recompute gets every plain Linear inside them back (base layers, lora_A, lora_B): 2 passes each,
    as under checkpointing. (The gradients' exactness with dropout: tests/test_integrations.py.)"""
    import peft

    model = build("llama", streaming_backward_chunk=4)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.3, target_modules=["q_proj", "k_proj", "v_proj"])
    model = peft.get_peft_model(model, config)
    rows = {}
    original = torch.nn.Linear.forward

    def counted(linear, x):
        rows[linear] = rows.get(linear, 0) + x.shape[:-1].numel()
        return original(linear, x)

    ids = plain_batch(5, seq=32)[0]
    monkeypatch.setattr(torch.nn.Linear, "forward", counted)
    model(input_ids=ids, labels=ids).loss.backward()
    monkeypatch.setattr(torch.nn.Linear, "forward", original)
    attention = model.base_model.model.model.layers[0].self_attn
    counts = {name: rows.get(linear, 0) / ids.numel() for name, linear in attention.named_modules()
              if type(linear) is torch.nn.Linear}
    assert len(counts) == 10 and set(counts.values()) == {2.0}, counts  # 3 x (base, A, B) and o_proj


def test_query_projection_skipped_only_where_nothing_else_changes():
    """cache.discardable_query_projection: a plain Linear or a LoRA-like module without dropout is skipped by a K/V
    pass; one holding a dropout with p > 0 (its draws come before k/v's, which the pass replays), one with hooks,
    or one without `out_features` is not. Skipped, it returns zeros of the projection's output shape and dtype."""
    from transformers.streaming_backward.cache import discardable_query_projection, queries_not_computed

    class LoraLike(torch.nn.Module):
        def __init__(self, dropout):
            super().__init__()
            self.base_layer, self.out_features = torch.nn.Linear(8, 12), 12
            self.lora_dropout = torch.nn.Dropout(dropout) if dropout else torch.nn.Identity()

        def forward(self, x):
            return self.base_layer(x) + self.lora_dropout(x).sum(-1, keepdim=True)

    def attention(q_proj):
        attn = torch.nn.Module()
        attn.q_proj = q_proj
        return attn

    plain, lora, lora_dropout = torch.nn.Linear(8, 12), LoraLike(0.0), LoraLike(0.1)
    hooked = torch.nn.Linear(8, 12)
    hooked.register_forward_hook(lambda *args: None)
    assert discardable_query_projection(attention(plain)) is plain
    assert discardable_query_projection(attention(lora)) is lora
    assert discardable_query_projection(attention(lora_dropout)) is None
    assert discardable_query_projection(attention(hooked)) is None
    assert discardable_query_projection(attention(torch.nn.Identity())) is None
    assert discardable_query_projection(torch.nn.Module()) is None  # no q_proj (e.g. a fused qkv_proj)
    x = torch.randn(2, 3, 8)
    with queries_not_computed(lora):
        skipped = lora(x)
    assert skipped.shape == (2, 3, 12) and skipped.dtype == x.dtype and not skipped.any()
    with torch.autocast("cpu", dtype=torch.bfloat16), queries_not_computed(plain):
        assert plain(x).dtype == torch.bfloat16
    assert torch.equal(lora(x), lora.base_layer(x) + x.sum(-1, keepdim=True))  # restored
    assert "forward" not in vars(lora)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_wrapper_fallback_exact(family, monkeypatch):
    """The autograd path that wrapped layers (ZeRO-3, FSDP1) take, forced in one process."""
    monkeypatch.setattr(generic, "layer_parameters", lambda layer: None)
    monkeypatch.setattr(generic.StreamedLayerFunction, "apply", None)  # must not run
    inputs = padded_batch(seed_of(family, "wrapped"))
    results = [train_step(build(family, streaming_backward_chunk=value), *inputs) for value in (None, 7)]
    (ref, ref_grads, _), (out, grads, _) = results
    assert_close(out.loss, ref.loss, what="loss")
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        assert_close(grads[name], ref_grads[name], what=name)


def test_offloaded_input_exact(monkeypatch):
    """activation_checkpointing_enable(offload=True): the streamed layer keeps its input in host memory."""
    from transformers.streaming_backward import offload

    saved = []

    class Recording(offload.HostStorage):
        def save(self, x):
            saved.append(tuple(x.shape))
            return super().save(x)

    compare("qwen3", 7, padded_batch(seed_of("offload")), monkeypatch, attn_implementation="sdpa")
    # compare() builds the model itself: enable offload on a fresh one and compare again.
    inputs = padded_batch(seed_of("offload"))
    ref = train_step(build("qwen3"), *inputs)
    model = build("qwen3", streaming_backward_chunk=7)
    model.activation_checkpointing_enable(offload=True)
    model.model.layers[0]._gradient_checkpointing_func.offload = Recording()  # offload.py: a storage may be the tag
    out = train_step(model, *inputs)
    assert saved == [(2, SEQ, COMMON["hidden_size"])] * 2
    assert_close(out[0].loss, ref[0].loss, what="loss")
    for name in ref[1]:
        assert_close(out[1][name], ref[1][name], what=name)


def test_attention_dropout_replayed(monkeypatch):
    """Dropout draws replayed per chunk: the Function path equals plain autograd through the same chunks."""
    inputs = padded_batch(31)
    runs = {}
    for name in ("function", "autograd", "no-dropout"):
        with monkeypatch.context() as patch:
            if name == "autograd":
                patch.setattr(generic, "layer_parameters", lambda layer: None)
            dropout = 0.0 if name == "no-dropout" else 0.3
            model = build("qwen3", streaming_backward_chunk=7, attention_dropout=dropout)
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


def test_layer_without_cache_seam_refused(monkeypatch):
    """A layer whose attention never calls `cache.update` (linear attention...) is refused, naming its class."""
    model = build("qwen3", streaming_backward_chunk=7)
    attn_class = type(model.model.layers[0].self_attn)
    real = attn_class.forward

    def no_cache(self, *args, cache=None, **kwargs):
        return real(self, *args, cache=None, **kwargs)

    monkeypatch.setattr(attn_class, "forward", no_cache)
    with pytest.raises(ValueError, match="Qwen3DecoderLayer cannot be streamed"):
        train_step(model, *padded_batch(1))


def test_filled_cache_and_empty_batch_refused(monkeypatch):
    from transformers import DynamicCache

    model = build("qwen3", streaming_backward_chunk=7).train()
    ids = torch.randint(1, 100, (1, 8))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True)
    with pytest.raises(ValueError, match="cached tokens"):
        model(input_ids=ids, cache=cache, labels=ids)
    with pytest.raises(ValueError, match="batch is empty"):
        model(inputs_embeds=torch.zeros(0, 8, COMMON["hidden_size"], requires_grad=True), labels=ids[:0])


def test_hooked_attention_takes_the_autograd_fallback(monkeypatch):
    """The generic layer calls `self_attn` itself, so its hooks run; a hook that may swap weights (FSDP2 on the
    attention module, accelerate) sends the layer to the autograd fallback instead of the Function."""
    monkeypatch.setattr(generic.StreamedLayerFunction, "apply", None)  # must not run
    inputs = padded_batch(seed_of("hooked"))
    ref = train_step(build("qwen3"), *inputs)
    model = build("qwen3", streaming_backward_chunk=7)
    seen = []
    for layer in model.model.layers:
        layer.self_attn.register_forward_pre_hook(lambda module, args: seen.append(1))
    out = train_step(model, *inputs)
    assert seen
    assert_close(out[0].loss, ref[0].loss, what="loss")
    for name in ref[1]:
        assert_close(out[1][name], ref[1][name], what=name)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("path", ["split", "views", "bias-only"])
def test_plain_causal_sdpa_uses_the_lower_right_bias(family, path, monkeypatch):
    """No mask: each chunk, forward and recompute, gets torch's lower-right causal bias (chunk, its causal prefix),
    split by it on the CPU in float32; with that off (half precision), every call after the forward's first chunk gets
    a view of one mask per layer call; with views off too, as on CUDA (test_streaming.py has the details)."""
    import contextlib

    from torch.nn.attention.bias import causal_lower_right
    from transformers.streaming_backward import layer, masks

    calls = []
    monkeypatch.setattr(masks, "causal_lower_right", lambda *size: calls.append(size) or causal_lower_right(*size))
    if path != "split":
        monkeypatch.setattr(masks, "SPLIT_DTYPES", ())
    if path == "bias-only":
        monkeypatch.setattr(layer.StreamedCall, "views_of_one_mask", lambda self: contextlib.nullcontext())
    compare(family, 7, plain_batch(seed_of(family, "bias", path)), monkeypatch, attn_implementation="sdpa")
    expected = [(min(start + 7, SEQ) - start, min(start + 7, SEQ)) for start in range(0, SEQ, 7)]
    if path == "views":
        assert calls == expected[:1] * COMMON["num_hidden_layers"]
    else:
        assert sorted(calls) == sorted(expected * 2 * COMMON["num_hidden_layers"])


MOE_FAMILIES = [("mixtral", "sdpa"), ("qwen3_moe", "sdpa"), ("gpt_oss", "eager"), ("olmoe", "sdpa"),
                ("deepseek_v3", "sdpa"), ("glm4_moe_lite", "eager"), ("llama4_text", "sdpa"), ("granitemoe", "sdpa"),
                ("granitemoeshared", "eager")]


@pytest.mark.parametrize(("family", "implementation"), MOE_FAMILIES)
@pytest.mark.parametrize("variant", ["function", "both flags", "fallback"])
def test_router_logits_and_aux_loss_exact(family, implementation, variant, monkeypatch):
    """output_router_logits=True in training (the auxiliary load-balancing loss, coefficient 1.0 in the tiny configs,
    added to the loss): the router logits come back whole, token-major, with their graph (streaming_backward/router.py),
    so the loss, the aux loss, the logits and every gradient equal the unsplit model's. Qwen3-MoE's, DeepSeek-V3's
    and GLM-4.7-Flash's first layer is dense (no router there); the last two (latent attention) add no aux loss. Left padding (blind chunks) and ignored labels; the Function, both
    flags, and the autograd fallback wrapped layers take."""
    if variant == "fallback":
        monkeypatch.setattr(generic, "layer_parameters", lambda layer: None)
    extra = dict(mini_sequence_chunk=3) if variant == "both flags" else {}
    inputs = padded_batch(seed_of(family, "router", variant))
    step_kwargs = dict(output_router_logits=True)
    reference = train_step(build(family, attn_implementation=implementation), *inputs, **step_kwargs)
    model = build(family, streaming_backward_chunk=5, attn_implementation=implementation, **extra)
    calls = []
    real = generic.StreamedLayerFunction.apply
    monkeypatch.setattr(generic.StreamedLayerFunction, "apply", lambda *args: calls.append(1) or real(*args))
    result = train_step(model, *inputs, **step_kwargs)
    assert len(calls) == (0 if variant == "fallback" else model.config.num_hidden_layers)
    assert_same_training(model, reference, result)
    ref_out, out = reference[0], result[0]
    if family in NO_AUX_LOSS:  # the router logits only (their gradient through the routing weights)
        assert ref_out.aux_loss is None and out.aux_loss is None
    else:
        assert ref_out.aux_loss is not None and ref_out.aux_loss.item() > 0
        assert_close(out.aux_loss, ref_out.aux_loss, what="aux_loss")
    assert len(out.router_logits) == len(ref_out.router_logits) > 0
    for got, expected in zip(out.router_logits, ref_out.router_logits):
        assert got.shape == expected.shape and got.requires_grad
        assert_close(got, expected, what="router_logits")


def test_router_logits_attached_to_the_aux_loss_gradient(monkeypatch):
    """The router weights' gradient depends on the aux loss's path through the recorded logits: handed over without
    their graph (as per-chunk capture in the no-grad streamed forward would give them), the gradients differ, so the
    test above can fail."""
    from transformers.streaming_backward import layer as streamed_layer

    inputs = padded_batch(seed_of("router", "detached"))
    reference = train_step(build("mixtral"), *inputs, output_router_logits=True)
    real = streamed_layer.router.hand_over
    monkeypatch.setattr(streamed_layer.router, "hand_over",
                        lambda result: real((result[0], result[1].detach()) if isinstance(result, tuple) else result))
    result = train_step(build("mixtral", streaming_backward_chunk=5), *inputs, output_router_logits=True)
    assert_close(result[0].loss, reference[0].loss, what="loss")  # the values are right, only the graph is missing
    name = next(n for n in reference[1] if n.endswith("mlp.gate.weight"))
    with pytest.raises(AssertionError, match="relative error"):
        assert_close(result[1][name], reference[1][name], what=name)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_bf16_as_accurate_as_upstream(family, monkeypatch):
    """bf16 through the generic layer (dK/dV and parameter gradients summed in fp32) is as accurate as upstream bf16."""
    from test_streaming import assert_bf16_as_accurate_as_upstream

    assert_bf16_as_accurate_as_upstream(family, streaming_backward_chunk=9)


@pytest.mark.parametrize("family", ["mixtral", "granitemoehybrid"])
def test_bf16_expert_weights_summed_in_their_own_dtype(family, monkeypatch):
    """bf16, streamed: a MoE block's stacked expert weights ([experts, out, in]) have their gradients summed over the
    chunks in bf16, as the mini-sequence MoE block sums them; every other parameter in fp32. Through the attention
    layer's backward (Mixtral) and the recurrent one's (Granite-4.0-H's Mamba2 layers, each with a MoE block), as
    accurate as upstream bf16 (Mixtral and Jamba with fp32 sums: the same error to 6e-6 of 4.3e-3)."""
    from test_streaming import assert_bf16_as_accurate_as_upstream
    from transformers.mst_core import grads

    sums = []  # (the gradient's shape, the sum's dtype), for every chunk's gradient added

    def recorded(acc, index, grad, fp32_sums):
        real(acc, index, grad, fp32_sums)
        if grad is not None:
            sums.append((tuple(grad.shape), acc[index].dtype))

    real = grads._add_grad
    monkeypatch.setattr(grads, "_add_grad", recorded)
    assert_bf16_as_accurate_as_upstream(family, streaming_backward_chunk=9)
    shapes = {name: tuple(param.shape) for name, param in make_model(family).named_parameters()}
    expert_shapes = {shape for name, shape in shapes.items() if ".experts." in name}
    assert expert_shapes and expert_shapes.isdisjoint(s for n, s in shapes.items() if ".experts." not in n)
    assert {dtype for shape, dtype in sums if shape in expert_shapes} == {torch.bfloat16}, sums
    assert {dtype for shape, dtype in sums if shape not in expert_shapes} == {torch.float32}, sums


@pytest.mark.parametrize(("family", "implementation"), [("qwen3", "sdpa"), ("qwen3", "eager"), ("gemma3_text", "eager"),
                                                     ("mixtral", "sdpa"), ("llama", "sdpa"), ("gemma2", "eager")])
@pytest.mark.parametrize("block_rows", [1, 10], ids=lambda rows: f"block_rows{rows}")
def test_exact_with_row_blocks(family, implementation, block_rows, monkeypatch):
    """dK/dV in row blocks of one chunk, or of two (chunk 5), each freed after its first chunk's turn; the chunk
    holding left-padding rows (it reads every key) runs first. Batch 2, left padding, ignored labels."""
    monkeypatch.setattr(rows, "BLOCK_ROWS", block_rows)
    compare(family, 5, padded_batch(seed_of(family, implementation, "blocks", block_rows)), monkeypatch,
            attn_implementation=implementation)


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text"])
def test_exact_with_row_blocks_and_sliding_window(family, monkeypatch):
    monkeypatch.setattr(rows, "BLOCK_ROWS", 1)
    for inputs in (padded_batch(seed_of(family, "blocks-window")), plain_batch(seed_of(family, "blocks-window"))):
        compare(family, 4, inputs, monkeypatch, attn_implementation="sdpa", **WINDOWED[family](6))


# ----------------------------------------------------------------------------- flash_attention_2 (CPU stand-in)
# test_streaming.py's reference kernels stand in for flash-attn (>= 2.1 semantics: causal and window aligned
# bottom-right per sequence, soft-capping, GQA); upstream's own FlashAttention glue runs around them. The reference
# asserts that no kernel call gets an empty query or key segment.
from test_streaming import flash_reference  # noqa: E402,F401  (a pytest fixture)

# Every streamed family but GPT-OSS first, then the four original ones (Gemma-2 too: FlashAttention soft-caps).
# Llama-4 neither: upstream refuses FlashAttention for chunked attention over more keys than a chunk.
FLASH_FAMILIES = sorted(set(GENERIC_FAMILIES) - {"gpt_oss", "llama4_text"}) + sorted(FAMILIES)


def flash_padded_batch(seed, seq=SEQ):
    """Batch 3: row 1 left-padded by 9 tokens, row 2 right-padded by 8 (whole chunks of padding in both rows: those
    rows have no query there), ignored labels."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, COMMON["vocab_size"], (3, seq), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    mask[2, -8:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, torch.randperm(seq, generator=gen)[: seq // 4]] = -100
    return ids, mask, labels


@pytest.mark.parametrize("family", FLASH_FAMILIES)
@pytest.mark.parametrize("chunk", [1, 7, SEQ + 5], ids=str)
def test_exact_flash_attention_padded(family, chunk, flash_reference, monkeypatch):
    compare(family, chunk, flash_padded_batch(seed_of(family, "flash", chunk)), monkeypatch, prepare=flash_reference)
    assert "reference_flash_varlen" in flash_reference.calls


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text", "mixtral", "llama"])
def test_exact_flash_attention_unpadded(family, flash_reference, monkeypatch):
    """No mask at all: each chunk reads its causal prefix, FlashAttention aligns the causal mask bottom-right."""
    compare(family, 5, plain_batch(seed_of(family, "flash-plain")), monkeypatch, prepare=flash_reference)
    assert "reference_flash" in flash_reference.calls


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text", "phi3", "mistral"])
@pytest.mark.parametrize("window", [4, 16], ids=lambda w: f"window{w}")
def test_exact_flash_attention_sliding_window(family, window, flash_reference, monkeypatch):
    """Window smaller and larger than the chunk (7), with padding and a hole in a row's mask (the window counts
    unpadded tokens: a padded chunk reads from key 0) and without a mask (a chunk reads from start - window + 1)."""
    ids, mask, labels = flash_padded_batch(seed_of(family, "flash-window", window))
    mask[0, 12:15] = 0
    for inputs in ((ids, mask, labels.masked_fill(mask == 0, -100)), plain_batch(seed_of(family, window))):
        compare(family, 7, inputs, monkeypatch, prepare=flash_reference, **WINDOWED[family](window))


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "gemma3_text", "llama"])
@pytest.mark.parametrize("how", ["position_ids", "cu_seq_lens"])
def test_exact_flash_attention_packed(family, how, flash_reference, monkeypatch):
    """Padding-free packing (TRL, DataCollatorWithFlattening): position_ids that restart, or FlashAttention's own
    cu_seq_lens/max_length kwargs. Chunk 5 against sequences of 13, 9 and 18 tokens: chunks that start inside a
    sequence, hold a whole one, or span two; Gemma-3 with a window of 4 on its sliding layers."""
    lengths = [13, 9, 18]
    gen = torch.Generator().manual_seed(seed_of(family, "flash-packed", how))
    ids = torch.randint(1, COMMON["vocab_size"], (1, sum(lengths)), generator=gen)
    labels = ids.clone()
    labels[0, torch.cumsum(torch.tensor(lengths), 0)[:-1]] = -100
    step_kwargs = {"position_ids": torch.cat([torch.arange(n) for n in lengths])[None]}
    if how == "cu_seq_lens":
        cu = torch.tensor([0, *torch.cumsum(torch.tensor(lengths), 0).tolist()], dtype=torch.int32)
        step_kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths), max_length_k=max(lengths))
    model_kwargs = WINDOWED[family](4) if family in WINDOWED else {}
    compare(family, 5, (ids, None, labels), monkeypatch, prepare=flash_reference, step_kwargs=step_kwargs,
            **model_kwargs)
    assert "reference_flash_varlen" in flash_reference.calls


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_exact_flash_attention_wrapper_path(family, flash_reference, monkeypatch):
    """The autograd fallback (ZeRO-3, FSDP1) with flash_attention_2, padded batch."""
    monkeypatch.setattr(generic, "layer_parameters", lambda layer: None)
    monkeypatch.setattr(generic.StreamedLayerFunction, "apply", None)  # must not run
    inputs = flash_padded_batch(seed_of(family, "flash-wrapped"))
    results = []
    for value in (None, 7):
        model = flash_reference(build(family, streaming_backward_chunk=value))
        results.append(train_step(model, *inputs))
    assert_same_training(model, *results)


def test_flash_attention_with_top_left_causal_mask_refused(flash_reference, monkeypatch):
    """flash-attn < 2.1 aligns the causal mask top-left: every chunk after the first would be wrong."""
    from transformers import modeling_flash_attention_utils as fa

    monkeypatch.setattr(fa, "flash_attn_supports_top_left_mask", lambda: True)
    model = flash_reference(build("qwen3", streaming_backward_chunk=4)).train()
    ids = torch.ones(1, 12, dtype=torch.long)
    with pytest.raises(ValueError, match=r"flash-attn aligns its causal mask top-left.*>= 2\.1"):
        model(input_ids=ids, labels=ids)


def test_own_router_collector_puts_the_models_back_while_compiling(monkeypatch):
    """While dynamo traces, upstream's collector variable is a plain global whose `reset` drops the value: the
    chunk's own collector (mst_core/router_logits.own_router_collector, used by the streamed layer and the mini-sequence
    MoE block) must leave the model's collector in place, compiling or not."""
    from transformers.mst_core.router_logits import own_router_collector
    from transformers.utils import output_capturing

    variable = output_capturing._active_collector
    for compiling in (False, True):
        monkeypatch.setattr(output_capturing, "is_torchdynamo_compiling", lambda: compiling)
        model_collector = {"router_logits": [], "hidden_states": []}
        token = variable.set(model_collector)
        try:
            with own_router_collector() as collected:
                assert variable.get() is collected and collected == {"router_logits": []}
            assert variable.get() is model_collector, compiling
        finally:
            variable.reset(token)
        assert variable.get() is None
    # Set while traced, then run eagerly (a streamed layer is `torch.compiler.disable`d inside a compiled model).
    monkeypatch.setattr(output_capturing, "is_torchdynamo_compiling", lambda: True)
    model_collector = {"router_logits": []}
    variable.set(model_collector)
    monkeypatch.setattr(output_capturing, "is_torchdynamo_compiling", lambda: False)
    try:
        with own_router_collector() as collected:
            assert variable.get() is collected
        assert variable.get() is model_collector
    finally:
        variable.reset(None)
    assert variable.get() is None

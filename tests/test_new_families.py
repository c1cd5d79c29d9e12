"""`mini_sequence_chunk` on the families added since 5.24.0+mst.9 (Qwen3, Phi-3, OLMo-2, Gemma-3 text and
Gemma3ForConditionalGeneration, Mixtral, Qwen3-MoE, GPT-OSS, Qwen3.5 text, OLMo-3, SmolLM3, Ministral-3, Gemma-4 text
and Gemma4ForConditionalGeneration): the flag, and exactness against the unsplit path.

Every comparison builds the same model twice from one seed, flag off (upstream path) and flag on, feeds both
the same fresh random batch (2 rows, left padding, ignored labels), and compares the loss, the gradient of every
parameter and of `inputs_embeds`. The families live in tiny_models.NEW_FAMILIES, not FAMILIES, so the heavy
parametrized tests of the other files do not run them.
"""

import logging
import zlib
from pathlib import Path

import pytest
import torch
import transformers
from conftest import run_py
from tiny_models import (COMMON, FAMILIES, MOE_FAMILIES, NEW_FAMILIES, NO_AUX_LOSS, REGISTRY, UNTRAINED_UPSTREAM, fp64_throughout,
                        make_config, make_model)
from test_streaming import flash_reference  # noqa: F401  (a pytest fixture)
from transformers.mini_sequence import lm_head_chunk_size

SEQ = 40
# At 40 tokens a chunk of 64 runs the path of SEQ + 5 (one MLP chunk, an uneven LM head over the batch's tokens).
CHUNKS = [1, 7, SEQ - 1, SEQ + 5, "auto"]
RTOL = 1e-5
# The family matrix: the flag and exactness on every family with a tiny config whose MLP, MoE block or LM head
# mini-sequences split (the hybrids': tests/test_streaming_recurrent.py).
MATRIX = sorted(FAMILIES) + sorted(NEW_FAMILIES)


def batch(seed, bsz=2, seq=SEQ, high=COMMON["vocab_size"]):
    """Random tokens, row 1 left-padded, a quarter of row 0's labels ignored; rows past the second: every label
    ignored."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, high, (bsz, seq), generator=gen)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :6] = 0
    labels = input_ids.clone()
    labels[attention_mask == 0] = -100
    labels[0, torch.randperm(seq, generator=gen)[: seq // 4]] = -100
    labels[2:] = -100
    return input_ids, attention_mask, labels


def train_step(model, input_ids, attention_mask, labels, embeds=True, **kwargs):
    """Loss, grads of all parameters (and of inputs_embeds when `embeds`), for one forward/backward."""
    model.train()
    if embeds:
        inputs = {"inputs_embeds": model.get_input_embeddings()(input_ids).detach().requires_grad_()}
    else:
        inputs = {"input_ids": input_ids}
    out = model(**inputs, attention_mask=attention_mask, labels=labels, **kwargs)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    # Every parameter that trains gets a gradient (none lost to the chunked paths); a text-only batch leaves the
    # multimodal model's vision tower and projector out (with images, the flag-off run's set is the reference).
    trained = {n for n, p in model.named_parameters() if p.requires_grad and UNTRAINED_UPSTREAM not in n}
    if embeds:  # the embedding's gradient is that of the detached inputs_embeds (compared), unless tied to lm_head
        embedding = model.get_input_embeddings().weight  # `embed_tokens`, Nemotron-H's `embeddings`
        assert grads.keys() >= trained - {n for n, p in model.named_parameters() if p is embedding}
    else:
        assert grads.keys() >= {n for n in trained if "vision_tower" not in n and "multi_modal_projector" not in n}
    return out, grads, (inputs["inputs_embeds"].grad if embeds else None)


def assert_close(actual, expected, rtol=RTOL, what=""):
    """Relative to the tensor's own scale, so a near-zero entry does not make the check vacuous."""
    scale = expected.abs().max().clamp_min(1e-12)
    err = ((actual.float() - expected.float()).abs().max() / scale).item()
    assert err <= rtol, f"{what}: relative error {err:.2e} > {rtol:.0e}"


# Qwen3.5's linear-attention decay parameters (one per head) get gradients that are small sums of large terms of both
# signs: in upstream's own fp32 step, nudging every MLP output and input gradient by one fp32 rounding moved them by
# up to 2.1e-5 relative (seeds 3-11; the mini-sequence step: up to 4.0e-5, at seed 5; every other gradient within
# 1e-6), and against fp64 upstream's fp32 and ours take turns being the closer. Still 40x below bf16's rounding.
ILL_CONDITIONED_RTOL = {"linear_attn.dt_bias": 1e-4, "linear_attn.A_log": 1e-4}
# With the router's aux loss (weight 1.0 in the tiny MoE configs) Qwen3.5-MoE's and Qwen3-Next's decay-parameter
# gradients are worse still: upstream's own fp32 step is up to 3.5e-3 from fp64 (seed 21), as far as bf16's rounding, so no tolerance
# against upstream fp32 means anything there; test_linear_attention_moe_decay_gradients_as_accurate_as_upstream compares them
# with fp64 instead, and the aux-loss tests leave them out (`fp64_checked`). Qwen3.5-MoE's unfused `in_proj_a`, which
# feeds the decay, too: upstream fp32 is 1.1e-5 to 1.9e-5 from fp64 there (seeds 3, 5, 21, 907), ours 1.0e-5 to 1.8e-5,
# so ours against upstream fp32 came out at 1.3e-5 on one CPU and under 1e-5 on another. Qwen3-Next fuses it with
# `in_proj_b` (`in_proj_ba`: 8.1e-7 from fp64 at most, checked against upstream fp32 like the rest).
_DECAY = ("linear_attn.dt_bias", "linear_attn.A_log")
FP64_CHECKED = {"qwen3_5_moe_text": (*_DECAY, "linear_attn.in_proj_a.weight"), "qwen3_next": _DECAY}


def assert_same_step(result, reference, fp64_checked=()):
    (out, grads, embed_grad), (ref, ref_grads, ref_embed_grad) = result, reference
    assert_close(out.loss, ref.loss, what="loss")
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        if name.endswith(fp64_checked):
            continue
        rtol = next((tol for suffix, tol in ILL_CONDITIONED_RTOL.items() if name.endswith(suffix)), RTOL)
        assert_close(grads[name], ref_grads[name], rtol=rtol, what=name)
    if ref_embed_grad is not None:
        assert_close(embed_grad, ref_embed_grad, what="inputs_embeds")


# ----------------------------------------------------------------------------- the flag


@pytest.mark.parametrize("family", MATRIX)
def test_bad_flag_rejected_at_construction(family):
    """Every family's config refuses each bad value (one validator, mst_core/fields.py: one case per family)."""
    for bad in (0, -3, 4.0, 1.5, True, False, "Auto", "max", "", [8], {"mlp": 8}):
        with pytest.raises(ValueError, match=r"mini_sequence_chunk.*None, \"auto\", or a positive int"):
            make_config(family, mini_sequence_chunk=bad)


@pytest.mark.parametrize("family", sorted(NEW_FAMILIES))
def test_flag_saved_and_not_reported_ignored(family, tmp_path, caplog):
    assert make_config(family).mini_sequence_chunk is None
    with caplog.at_level(logging.WARNING):
        model = make_model(family, mini_sequence_chunk=16)
    assert "is ignored" not in caplog.text
    model.save_pretrained(tmp_path)
    assert type(model).from_pretrained(tmp_path).config.mini_sequence_chunk == 16


# One process per side, every new family in it (a process per family and side would cost ~6 s each).
_PROBE_ALL = (
    "import runpy, sys\n"
    "probe, out_dir, families = sys.argv[1], sys.argv[2], sys.argv[3:]\n"
    "for family in families:\n"
    "    sys.argv = [probe, family, f'{out_dir}/{family}.pt']\n"
    "    runpy.run_path(probe, run_name='__main__')\n"
)


def test_flag_off_bit_identical_to_pristine_upstream(pristine_tree, tmp_path):
    """With the field unset, each new family's loss, logits and gradients (with and without checkpointing) are
    upstream 5.24.0's bit for bit (tests/flag_off_probe.py, run against the installed package and the pristine
    wheel)."""
    probe = str(Path(__file__).parent / "flag_off_probe.py")
    families = sorted(NEW_FAMILIES)
    for side, env in (("ours", None), ("upstream", {"PYTHONPATH": str(pristine_tree)})):
        (tmp_path / side).mkdir()
        run_py(["-c", _PROBE_ALL, probe, str(tmp_path / side), *families], env_extra=env, check=True)
    for family in families:
        a, b = torch.load(tmp_path / "ours" / f"{family}.pt"), torch.load(tmp_path / "upstream" / f"{family}.pt")
        assert b["file"].startswith(str(pristine_tree)) and a["file"] == transformers.__file__, family
        assert torch.equal(a["loss"], b["loss"]) and torch.equal(a["logits"], b["logits"]), family
        assert a["grads"].keys() == b["grads"].keys(), family
        for name in a["grads"]:
            for key in ("grads", "checkpointed_grads"):
                ours, theirs = a[key][name], b[key][name]
                # None on both sides only where upstream trains nothing (DeepSeek Sparse Attention's indexer)
                assert (ours is None) == (theirs is None) and (ours is None) == (UNTRAINED_UPSTREAM in name), name
                assert ours is None or torch.equal(ours, theirs), (family, key, name)


# ----------------------------------------------------------------------------- exactness, fp32


@pytest.mark.parametrize("family", MATRIX)
@pytest.mark.parametrize("chunk", CHUNKS, ids=str)
def test_exact_against_unsplit(family, chunk):
    """Three rows (left padding, ignored labels, a row whose labels are all ignored), fp32, every gradient."""
    # crc32, not hash(): str hashes change with PYTHONHASHSEED, so a failure would not reproduce.
    inputs = batch(zlib.crc32(f"new/{family}/{chunk}".encode()) % 1000, bsz=3)
    reference = train_step(make_model(family), *inputs)
    result = train_step(make_model(family, mini_sequence_chunk=chunk), *inputs)
    config = make_config(family)
    num_tokens = inputs[2].numel()
    # The chunked loss never builds the logits; a batch that is one LM-head chunk takes upstream's path.
    lm_chunk = lm_head_chunk_size(chunk, config.hidden_size, config.vocab_size, num_tokens)
    assert (result[0].logits is None) == (lm_chunk < num_tokens)
    assert_same_step(result, reference)


@pytest.mark.parametrize("family", MATRIX)
def test_exact_with_gradient_checkpointing(family):
    assert_checkpointed_step_exact(family, batch(5))


def assert_checkpointed_step_exact(family, inputs):
    """Under activation checkpointing, chunks of 7 against the flag unset."""
    results = []
    for chunk in (None, 7):
        model = make_model(family, mini_sequence_chunk=chunk)
        model.activation_checkpointing_enable()
        results.append(train_step(model, *inputs))
    assert_same_step(results[1], results[0])


MLP_FAMILIES = sorted(t for t, f in REGISTRY.items() if f.tiny and f.mini_sequence in ("mlp", "moe"))


@pytest.mark.parametrize("family", MLP_FAMILIES)
def test_exact_with_a_batch_of_one_sequence(family):
    """A batch of one sequence (left-padded, ignored labels) under checkpointing: the dense MLPs (the MoE families' too:
    their dense layers and shared experts) and the norms then run their chunks on the tokens' rows [S, d]
    (mini_sequence/mlp.py `chunked_function`, `token_rows`), the batch's [1, S, d] elsewhere; the other tests' batches
    of 2 and 3 never take that path."""
    one_sequence = [tensor[1:] for tensor in batch(zlib.crc32(f"one/{family}".encode()) % 1000)]
    assert_checkpointed_step_exact(family, one_sequence)


@pytest.mark.parametrize("family", sorted(f for f in NEW_FAMILIES if REGISTRY[f].mini_sequence == "mlp")
                         + ["qwen3_moe"])
def test_mlp_body_runs_per_mini_sequence(family, monkeypatch):
    """The MLP's own upstream forward runs once per chunk (nothing re-spelled): every Linear of the MLP sees at
    most `chunk` tokens per row, and the down projection sees every token once per forward and once per backward.
    (Qwen3-MoE's layer 0 is its dense MLP.)"""
    chunk = 7
    model = make_model(family, mini_sequence_chunk=chunk)
    layer = model.model.layers[0]
    mlp = layer.mlp if hasattr(layer, "mlp") else layer.feed_forward  # Falcon-H1's `feed_forward`
    seen = []
    original = torch.nn.Linear.forward

    def counted(linear, x):
        if linear is mlp.down_proj:
            seen.append(x.shape[-2])
        return original(linear, x)

    monkeypatch.setattr(torch.nn.Linear, "forward", counted)
    train_step(model, *batch(6))
    assert max(seen) <= chunk and sum(seen) == 2 * SEQ


# The layer's recompute stops before the MLP (`SavedInput`, mst_core/wrappers.py); OLMo-2's and Gemma-3's post-feedforward norm, which
# would save the MLP's whole output, runs by mini-sequences with the MLP (`mini_sequence_mlp_then_norm`). Gemma-4's
# layer saves tensors after its MLP (the per-layer-input gate its input; `hidden_states *= self.layer_scalar` the
# scalar): the recompute has to run the whole layer, the chunked MLP included, before the MLP's backward rebuilds
# each chunk once more (3 passes; measured 2 with both taken out of the layer; docs/limits.md).
MLP_RUNS_WITH_CHECKPOINTING = {"qwen3": 2.0, "phi3": 2.0, "olmo2": 2.0, "gemma3_text": 2.0, "olmo3": 2.0, "smollm3": 2.0,
                               "ministral3": 2.0, "gemma4_text": 3.0, "deepseek_v2": 2.0, "deepseek_v3": 2.0,
                               "glm4_moe": 2.0, "glm4_moe_lite": 2.0}  # the MoE families' dense layer 0


@pytest.mark.parametrize("family", sorted(MLP_RUNS_WITH_CHECKPOINTING))
def test_checkpointing_mlp_runs_per_step(family, monkeypatch):
    """Tokens through the first layer's down projection per token of the batch in one checkpointed step: 2 without
    the flag (forward, recompute); with it too (forward, the mini-sequence backward's rebuild of each chunk)."""
    original = torch.nn.Linear.forward
    runs = []
    for chunk in (None, 7):
        model = make_model(family, mini_sequence_chunk=chunk)
        model.activation_checkpointing_enable()
        down, rows = model.model.layers[0].mlp.down_proj, [0]

        def counted(linear, x, down=down, rows=rows):
            if linear is down:
                rows[0] += x.shape[:-1].numel()
            return original(linear, x)

        monkeypatch.setattr(torch.nn.Linear, "forward", counted)
        input_ids, attention_mask, labels = batch(4)
        train_step(model, input_ids, attention_mask, labels)
        runs.append(rows[0] / input_ids.numel())
    assert runs == [2.0, MLP_RUNS_WITH_CHECKPOINTING[family]]


@pytest.mark.parametrize("family", ["granite", "granitemoe"])
def test_granite_head_with_a_bias_is_refused(family):
    """Granite's heads divide the logits by `logits_scaling`; the chunked loss divides the hidden states instead,
    the same only for a head without bias (upstream builds none): a head given one is refused, naming it."""
    model = make_model(family, mini_sequence_chunk=7).train()
    model.lm_head = torch.nn.Linear(COMMON["hidden_size"], COMMON["vocab_size"], bias=True)
    input_ids, attention_mask, labels = batch(3)
    with pytest.raises(ValueError, match="lm_head has a bias.*logits_scaling=3.0"):
        model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


@pytest.mark.parametrize("family", MATRIX)
def test_eval_keeps_upstream_logits(family):
    ids, mask, labels = batch(10)
    ref = make_model(family).eval()(input_ids=ids, attention_mask=mask, labels=labels)
    out = make_model(family, mini_sequence_chunk=7).eval()(input_ids=ids, attention_mask=mask, labels=labels)
    assert out.logits is not None
    assert_close(out.logits, ref.logits, what="logits")
    assert_close(out.loss, ref.loss, what="loss")


# ----------------------------------------------------------------------------- Gemma-3 multimodal


def gemma3_multimodal(seed=0, **text_overrides):
    config = transformers.Gemma3Config(
        text_config={**COMMON, **NEW_FAMILIES["gemma3_text"][2], **text_overrides},
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=16, patch_size=4),
        mm_tokens_per_image=4, image_token_index=COMMON["vocab_size"] - 1, boi_token_index=COMMON["vocab_size"] - 3,
        eoi_token_index=COMMON["vocab_size"] - 2,
    )
    torch.manual_seed(seed)
    return transformers.Gemma3ForConditionalGeneration(config)


@pytest.mark.parametrize("chunk", [7, "auto"], ids=str)
def test_gemma3_conditional_generation_text_config_flag(chunk, caplog):
    """`text_config.mini_sequence_chunk` splits the language model's MLP and chunks the composite's own LM head +
    loss (no softcapping there, as upstream's Gemma3ForConditionalGeneration); no 'ignored' warning."""
    inputs = batch(zlib.crc32(f"gemma3-mm/{chunk}".encode()) % 1000, high=COMMON["vocab_size"] - 3)
    reference = train_step(gemma3_multimodal(), *inputs, embeds=False)
    with caplog.at_level(logging.WARNING):
        model = gemma3_multimodal(mini_sequence_chunk=chunk)
    assert "ignored" not in caplog.text and "upstream's way" not in caplog.text
    result = train_step(model, *inputs, embeds=False)
    assert (result[0].logits is None) == (chunk == 7)
    assert_same_step(result, reference)


@pytest.mark.parametrize("chunk", [3, 7], ids=str)
def test_gemma3_conditional_generation_streams_images(chunk, monkeypatch):
    """`text_config.streaming_backward_chunk` on Gemma-3 as users load it, with images: the image tokens attend to each
    other both ways (`token_type_ids`), so a chunk that splits an image block reads every key (masks.plan_key_ranges);
    both flags, exact against the unsplit composite (vision tower and projector gradients included)."""
    from transformers.streaming_backward import layer as streamed_layer

    vocab = COMMON["vocab_size"]
    gen = torch.Generator().manual_seed(chunk)
    ids = torch.randint(1, vocab - 3, (2, 24), generator=gen)
    ids[:, 5], ids[:, 6:10], ids[:, 10] = vocab - 3, vocab - 1, vocab - 2  # boi, 4 image tokens, eoi
    token_type_ids = (ids == vocab - 1).long()
    pixel_values = torch.randn(2, 3, 16, 16, generator=gen)
    labels = ids.masked_fill(token_type_ids.bool(), -100)

    def step(model):
        model.train()
        out = model(input_ids=ids, pixel_values=pixel_values, token_type_ids=token_type_ids, labels=labels)
        out.loss.backward()
        return out.loss, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    ref_loss, ref_grads = step(gemma3_multimodal())
    calls = []
    real = streamed_layer.StreamedLayerFunction.apply
    monkeypatch.setattr(streamed_layer.StreamedLayerFunction, "apply", lambda *args: calls.append(1) or real(*args))
    loss, grads = step(gemma3_multimodal(streaming_backward_chunk=chunk, mini_sequence_chunk=4))
    assert len(calls) == NEW_FAMILIES["gemma3_text"][2].get("num_hidden_layers", COMMON["num_hidden_layers"])
    assert_close(loss, ref_loss, what="loss")
    assert grads.keys() == ref_grads.keys() and any("vision" in n for n in grads)
    for name in ref_grads:
        assert_close(grads[name], ref_grads[name], what=name)


# ----------------------------------------------------------------------------- Qwen3.5-MoE, Qwen3-Next


# fp32 summation-order noise in these tiny models' gradients, relative to a tensor's largest fp64 entry: one seed's
# upstream error can be far below its usual level, and CPUs differ in it (their fp32 GEMMs sum in other orders). On an
# AVX-512 machine (2026-11-28), over 20 seeds ours came out at up to 3.2x upstream's error with upstream at 5.6e-6 (the
# Qwen3-Next decay gradients), and at up to 1.6e-5 from fp64 with upstream at 1.9e-6 (Gemma-4, every gradient, 7
# seeds); where these checks were written, within 1.35x (8 seeds). 3e-5 is still far below what they are for: a gradient
# rounded through bf16 is ~4e-3 off, through fp16 ~5e-4, and a lost term is off by its own size.
FP32_NOISE = 3e-5


def assert_as_accurate_as_upstream(ours, upstream, fp64, names, where=""):
    """Each gradient in `names` as close to fp64 as upstream's fp32 one: within twice its error (relative to the fp64
    tensor's scale), plus `FP32_NOISE`."""
    for name in names:
        err, err_up = [((g[name].double() - fp64[name]).abs().max() / fp64[name].abs().max()).item()
                       for g in (ours, upstream)]
        assert err <= 2 * err_up + FP32_NOISE, f"{where}{name}: {err:.2e} from fp64, upstream fp32 {err_up:.2e}"


@pytest.mark.parametrize("family", sorted(FP64_CHECKED))
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_linear_attention_moe_decay_gradients_as_accurate_as_upstream(family, checkpointing):
    """With the router's aux loss, the linear-attention decay parameters' gradients (`FP64_CHECKED`) are as close to
    fp64 as upstream's fp32 ones (within twice their error plus `FP32_NOISE`; measured ratios 0.5-1.35 over 8 seeds
    where this was written, 0.5-3.2 over 20 on an AVX-512 machine, errors 5e-6 to 1.5e-4): a lost or half-precision
    term would be 10x-1000x off. Experts on the eager path, which runs fp64 (grouped_mm does not)."""
    for seed in (907, 21, 3):
        inputs = batch(seed)

        def grads(dtype, chunk):
            model = make_model(family, mini_sequence_chunk=chunk, experts_implementation="eager").to(dtype)
            if checkpointing:
                model.activation_checkpointing_enable()
            return train_step(model, *inputs, output_router_logits=True)[1]

        fp64, upstream, ours = grads(torch.float64, None), grads(torch.float32, None), grads(torch.float32, 7)
        checked = [name for name in fp64 if name.endswith(FP64_CHECKED[family])]
        assert len(checked) == len(FP64_CHECKED[family])
        assert_as_accurate_as_upstream(ours, upstream, fp64, checked, where=f"seed {seed}, ")


# ----------------------------------------------------------------------------- Llama-4


def test_llama4_checkpoint_through_auto_model_for_causal_lm(tmp_path, caplog, monkeypatch):
    """What a Llama-4 user runs: a `llama4` (multimodal) checkpoint loaded by AutoModelForCausalLM, which builds
    Llama4ForCausalLM from its text config, with `from_pretrained(path, mini_sequence_chunk=...)`: the field reaches
    the text config (patch 0014), the chunked loss runs (no logits), both layers stream with
    `streaming_backward_chunk`, and every gradient equals the unset step's."""
    from transformers.streaming_backward import layer as streamed_layer

    text = {**COMMON, **NEW_FAMILIES["llama4_text"][2]}
    vision = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, image_size=16,
                  patch_size=8, vision_output_dim=16, projector_input_dim=16, projector_output_dim=16)
    torch.manual_seed(0)
    transformers.Llama4ForConditionalGeneration(
        transformers.Llama4Config(text_config=text, vision_config=vision)).save_pretrained(tmp_path)
    inputs = batch(41)
    reference = train_step(transformers.AutoModelForCausalLM.from_pretrained(tmp_path), *inputs)
    with caplog.at_level(logging.WARNING):
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, mini_sequence_chunk=7,
                                                                  streaming_backward_chunk=5)
    assert type(model).__name__ == "Llama4ForCausalLM" and model.config.mini_sequence_chunk == 7
    assert "is ignored" not in caplog.text
    calls = []
    real = streamed_layer.StreamedLayerFunction.apply
    monkeypatch.setattr(streamed_layer.StreamedLayerFunction, "apply", lambda *args: calls.append(1) or real(*args))
    result = train_step(model, *inputs)
    assert len(calls) == model.config.num_hidden_layers
    assert result[0].logits is None and reference[0].logits is not None
    assert_same_step(result, reference)


# ----------------------------------------------------------------------------- Gemma-4

# What the released Gemma-4 configs have and the tiny one leaves out: the last layers read the K/V that earlier layers
# stored, with double-wide MLPs (E2B, E4B), and a MoE block beside each layer's MLP (26B-A4B).
GEMMA4_RELEASED_PARTS = dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2,
                             num_kv_shared_layers=2, use_double_wide_mlp=True, enable_moe_block=True, num_experts=4,
                             top_k_experts=2, moe_intermediate_size=16)


@pytest.mark.parametrize("chunk", [5, "auto"], ids=str)
def test_gemma4_text_shared_kv_double_wide_mlp_and_moe_block(chunk):
    """Exact with the parts of the released configs (the MoE block runs unsplit, its MLP neighbour by mini-sequences,
    each normed as upstream's)."""
    inputs = batch(zlib.crc32(f"gemma4/{chunk}".encode()) % 1000)
    reference = train_step(make_model("gemma4_text", **GEMMA4_RELEASED_PARTS), *inputs)
    model = make_model("gemma4_text", mini_sequence_chunk=chunk, **GEMMA4_RELEASED_PARTS)
    assert model.model.layers[3].mlp.intermediate_size == 2 * COMMON["intermediate_size"]  # double-wide, K/V reused
    assert_same_step(train_step(model, *inputs), reference)


def count_split_blocks(monkeypatch):
    """A list that gets the name of each mini-sequence path that splits an MLP or a MoE block, as it runs."""
    from transformers.mini_sequence import integration

    split = []
    for name in ("mini_sequence_mlp", "mini_sequence_moe"):
        real = getattr(integration, name)
        monkeypatch.setattr(integration, name, lambda *a, real=real, name=name, **kw: split.append(name) or real(*a, **kw))
    return split


def count_streamed_calls(monkeypatch):
    """A list that gets one item per call of the streamed layer's Function."""
    from transformers.streaming_backward import layer as streamed_layer

    calls = []
    real = streamed_layer.StreamedLayerFunction.apply
    monkeypatch.setattr(streamed_layer.StreamedLayerFunction, "apply", lambda *args: calls.append(1) or real(*args))
    return calls


@pytest.mark.parametrize("chunk", [5, 16], ids=str)
def test_gemma4_text_streams_with_per_layer_inputs_and_moe_block(chunk, monkeypatch):
    """Without K/V shared across layers (26B-A4B's MoE block beside the MLP, 4 layers): every layer streamed, both
    fields; the per-layer inputs' gradients (their embedding and projection) summed chunk by chunk. Every gradient as
    close to fp64 as upstream's fp32 one (within twice its error, plus `FP32_NOISE`): upstream's own fp32 norm-weight
    gradients are up to 1.1e-5 from fp64 here, so against upstream fp32 ours came out at 1.05e-5 (chunk 5). Experts on
    the eager path, which runs fp64 (grouped_mm does not); token ids in, as Gemma-4 embeds them per layer too."""
    parts = {**GEMMA4_RELEASED_PARTS, "num_kv_shared_layers": 0, "experts_implementation": "eager"}
    inputs = batch(zlib.crc32(f"gemma4-streamed/{chunk}".encode()) % 1000)
    fp64 = train_step(make_model("gemma4_text", **parts).double(), *inputs, embeds=False)
    upstream = train_step(make_model("gemma4_text", **parts), *inputs, embeds=False)
    calls = count_streamed_calls(monkeypatch)
    model = make_model("gemma4_text", streaming_backward_chunk=chunk, mini_sequence_chunk=4, **parts)
    ours = train_step(model, *inputs, embeds=False)
    assert len(calls) == parts["num_hidden_layers"]
    assert_close(ours[0].loss, upstream[0].loss, what="loss")
    assert ours[1].keys() == upstream[1].keys() == fp64[1].keys() and any("per_layer" in n for n in ours[1])
    assert_as_accurate_as_upstream(ours[1], upstream[1], fp64[1], fp64[1])


def test_gemma4_text_with_shared_kv_not_streamed_and_warned(monkeypatch, caplog):
    """K/V shared across layers (E2B, E4B): the field is ignored with a warning that names `num_kv_shared_layers`, and
    the step is upstream's."""
    inputs = batch(zlib.crc32(b"gemma4-shared-kv") % 1000)
    reference = train_step(make_model("gemma4_text", **GEMMA4_RELEASED_PARTS), *inputs)
    calls = count_streamed_calls(monkeypatch)
    with caplog.at_level(logging.WARNING):
        model = make_model("gemma4_text", streaming_backward_chunk=6, **GEMMA4_RELEASED_PARTS)
    assert "num_kv_shared_layers=2" in caplog.text and "streaming_backward_chunk=6 is ignored" in caplog.text
    result = train_step(model, *inputs)
    assert not calls
    assert_same_step(result, reference)


def gemma4_multimodal(seed=0, vision=False, **text_overrides):
    vocab = COMMON["vocab_size"]
    config = transformers.Gemma4Config(
        text_config={**COMMON, **NEW_FAMILIES["gemma4_text"][2], **text_overrides},
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=2, head_dim=8, patch_size=4, pooling_kernel_size=2,
                           position_embedding_size=64) if vision else None,
        boi_token_id=vocab - 3, eoi_token_id=vocab - 2, image_token_id=vocab - 1, video_token_id=vocab - 4,
        boa_token_id=vocab - 5, eoa_token_index=vocab - 6, audio_token_id=vocab - 7,
    )
    torch.manual_seed(seed)
    return transformers.Gemma4ForConditionalGeneration(config)


@pytest.mark.parametrize("chunk", [7, "auto"], ids=str)
def test_gemma4_conditional_generation_text_config_flag(chunk, caplog):
    """What AutoModelForCausalLM builds from a `gemma4` checkpoint: `text_config.mini_sequence_chunk` splits the
    language model's MLP and chunks the composite's LM head + loss, softcapped by the text config's cap as upstream's
    (the tiny cap, 2.0, bends the logits: left out, the gradients moved by 4e-3); no 'ignored' warning."""
    inputs = batch(zlib.crc32(f"gemma4-mm/{chunk}".encode()) % 1000, high=COMMON["vocab_size"] - 8)
    reference = train_step(gemma4_multimodal(), *inputs, embeds=False)
    with caplog.at_level(logging.WARNING):
        model = gemma4_multimodal(mini_sequence_chunk=chunk)
    assert model.config.get_text_config().final_logit_softcapping == 2.0
    assert "ignored" not in caplog.text and "upstream's way" not in caplog.text
    result = train_step(model, *inputs, embeds=False)
    assert (result[0].logits is None) == (chunk == 7)
    assert_same_step(result, reference)


def test_gemma4_conditional_generation_with_images():
    """With an image per row (its soft token's label ignored): exact, the vision tower's gradients included."""
    vocab = COMMON["vocab_size"]
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, vocab - 8, (2, SEQ), generator=gen)
    ids[:, 5], ids[:, 6], ids[:, 7] = vocab - 3, vocab - 1, vocab - 2  # boi, the image's one soft token, eoi
    images = dict(pixel_values=torch.randn(2, 4, 48, generator=gen),  # 2x2 patches of 4x4 pixels, pooled to one token
                  image_position_ids=torch.tensor([[0, 0], [1, 0], [0, 1], [1, 1]]).expand(2, 4, 2).clone())
    labels = ids.masked_fill(ids == vocab - 1, -100)
    inputs = (ids, torch.ones_like(ids), labels)
    reference = train_step(gemma4_multimodal(vision=True), *inputs, embeds=False, **images)
    result = train_step(gemma4_multimodal(vision=True, mini_sequence_chunk=7), *inputs, embeds=False, **images)
    assert any("vision_tower" in name for name in reference[1])
    assert_same_step(result, reference)


@pytest.mark.parametrize("chunk", [3, 7], ids=str)
def test_gemma4_conditional_generation_streams_with_images(chunk, monkeypatch):
    """`text_config.streaming_backward_chunk` on Gemma-4 as AutoModelForCausalLM loads it, with an image per row: both
    flags, exact against the unsplit composite (vision tower, per-layer inputs included)."""
    vocab = COMMON["vocab_size"]
    gen = torch.Generator().manual_seed(30 + chunk)
    ids = torch.randint(1, vocab - 8, (2, SEQ), generator=gen)
    ids[:, 5], ids[:, 6], ids[:, 7] = vocab - 3, vocab - 1, vocab - 2  # boi, the image's one soft token, eoi
    images = dict(pixel_values=torch.randn(2, 4, 48, generator=gen),
                  image_position_ids=torch.tensor([[0, 0], [1, 0], [0, 1], [1, 1]]).expand(2, 4, 2).clone())
    labels = ids.masked_fill(ids == vocab - 1, -100)
    inputs = (ids, torch.ones_like(ids), labels)
    reference = train_step(gemma4_multimodal(vision=True), *inputs, embeds=False, **images)
    calls = count_streamed_calls(monkeypatch)
    model = gemma4_multimodal(vision=True, streaming_backward_chunk=chunk, mini_sequence_chunk=4)
    result = train_step(model, *inputs, embeds=False, **images)
    assert len(calls) == COMMON["num_hidden_layers"]
    assert any("vision_tower" in name for name in reference[1])
    assert_same_step(result, reference)


# ----------------------------------------------------------------------------- Qwen3-VL

# Qwen3-VL's tiny text stack: Qwen3's sizes, heads of 8 with multimodal rotary sections of 2 + 1 + 1 frequencies (time,
# height, width, interleaved as the releases). Tiny vision tower: one block whose features also go to the deepstack.
QWEN3_VL_TEXT = dict(COMMON, head_dim=8, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                          "mrope_section": [2, 1, 1], "mrope_interleaved": True})
QWEN3_VL_VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4, temporal_patch_size=2,
                       spatial_merge_size=2, out_hidden_size=COMMON["hidden_size"], num_position_embeddings=16,
                       deepstack_visual_indexes=[0])
VL_IMAGE, VL_VIDEO = COMMON["vocab_size"] - 1, COMMON["vocab_size"] - 2  # placeholder tokens (start/end: -3, -4)


# Qwen3-VL-MoE's: layer 0 dense, layer 1 4 experts of 16 (top 2), the aux loss weighted 1.0.
QWEN3_VL_MOE_TEXT = dict(QWEN3_VL_TEXT, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                         mlp_only_layers=[0], router_aux_loss_coef=1.0)


def qwen3_vl(seed=0, moe=False, **text_overrides):
    vocab = COMMON["vocab_size"]
    config_class = transformers.Qwen3VLMoeConfig if moe else transformers.Qwen3VLConfig
    config = config_class(
        text_config={**(QWEN3_VL_MOE_TEXT if moe else QWEN3_VL_TEXT), **text_overrides}, vision_config=QWEN3_VL_VISION,
        image_token_id=VL_IMAGE, video_token_id=VL_VIDEO, vision_start_token_id=vocab - 3,
        vision_end_token_id=vocab - 4,
    )
    torch.manual_seed(seed)
    model_class = transformers.Qwen3VLMoeForConditionalGeneration if moe else transformers.Qwen3VLForConditionalGeneration
    return model_class(config)


def qwen3_vl_batch(seed, with_video=False):
    """Batch 2 of SEQ tokens, row 1 left-padded by 6: an image of 4x4 patches (4 tokens after the 2x2 merge) in each
    row, and with `with_video` a video of 2 frames of 4x4 patches (4 tokens each) in row 0; the placeholders' labels
    ignored, as the processors' collators do. Returns the model's keyword arguments."""
    vocab = COMMON["vocab_size"]
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab - 8, (2, SEQ), generator=gen)
    attention_mask = torch.ones_like(ids)
    attention_mask[1, :6] = 0
    ids[:, 9], ids[:, 10:14], ids[:, 14] = vocab - 3, VL_IMAGE, vocab - 4
    patch = 3 * 2 * 4 * 4  # channels x temporal patch x patch x patch
    inputs = dict(pixel_values=torch.randn(2 * 16, patch, generator=gen), image_grid_thw=torch.tensor([[1, 4, 4]] * 2))
    if with_video:  # one frame per grid row, as the processor lays a video out (its timestamps are text between)
        for start in (20, 27):
            ids[0, start], ids[0, start + 1 : start + 5], ids[0, start + 5] = vocab - 3, VL_VIDEO, vocab - 4
        inputs.update(pixel_values_videos=torch.randn(2 * 16, patch, generator=gen),
                      video_grid_thw=torch.tensor([[1, 4, 4]] * 2))
    mm_token_type_ids = (ids == VL_IMAGE).int() + 2 * (ids == VL_VIDEO).int()
    labels = ids.masked_fill((attention_mask == 0) | (mm_token_type_ids > 0), -100)
    labels[0, torch.randperm(SEQ, generator=gen)[: SEQ // 4]] = -100
    return dict(input_ids=ids, attention_mask=attention_mask, labels=labels, mm_token_type_ids=mm_token_type_ids,
                **inputs)


def composite_step(model, inputs):
    """(outputs, every parameter gradient, the names of the parameters that train)."""
    model.train()
    out = model(**inputs)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads, {n for n, p in model.named_parameters() if p.requires_grad}


def assert_same_composite_step(result, reference, every_parameter=True, fp64_checked=()):
    """Same loss and gradients as the unsplit composite; with `every_parameter` (images in the batch), every
    parameter that trains got a gradient. Gradients named by `fp64_checked` suffixes are judged elsewhere, in fp64."""
    (out, grads, trained), (ref, ref_grads, _) = result, reference
    assert_close(out.loss, ref.loss, what="loss")
    assert grads.keys() == ref_grads.keys()
    if every_parameter:
        assert grads.keys() == trained, trained - grads.keys()
    for name in ref_grads:
        if not name.endswith(fp64_checked):
            assert_close(grads[name], ref_grads[name], what=name)


@pytest.mark.parametrize("chunk", [7, "auto"], ids=str)
def test_qwen3_vl_text_config_flag(chunk, caplog):
    """Qwen3-VL as users load it (`Qwen3VLForConditionalGeneration`), text only: `text_config.mini_sequence_chunk`
    splits the text MLP and chunks the composite's LM head + loss (no logits); no 'ignored' warning."""
    inputs = qwen3_vl_batch(zlib.crc32(f"qwen3-vl/{chunk}".encode()) % 1000)
    text_only = {k: v for k, v in inputs.items() if k in ("input_ids", "attention_mask")}
    text_only["labels"] = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
    reference = composite_step(qwen3_vl(), text_only)
    with caplog.at_level(logging.WARNING):
        model = qwen3_vl(mini_sequence_chunk=chunk)
    assert "ignored" not in caplog.text and "upstream's way" not in caplog.text
    result = composite_step(model, text_only)
    assert (result[0].logits is None) == (chunk == 7)
    assert_same_composite_step(result, reference, every_parameter=False)  # no image: the vision tower gets none


@pytest.mark.parametrize(("chunk", "stream"), [(7, None), (4, 5), (4, 16)], ids=str)
@pytest.mark.parametrize("with_video", [False, True], ids=["image", "image+video"])
def test_qwen3_vl_with_images_and_videos(chunk, stream, with_video, monkeypatch):
    """With an image per row (and a video in row 0), their multimodal rotary positions and deepstack features, a
    left-padded row: mini-sequences, and both fields (every text layer streamed), exact against the unsplit composite,
    the vision tower's and merger's gradients included."""
    inputs = qwen3_vl_batch(zlib.crc32(f"qwen3-vl/{chunk}/{stream}/{with_video}".encode()) % 1000, with_video)
    reference = composite_step(qwen3_vl(), inputs)
    calls, split = count_streamed_calls(monkeypatch), count_split_blocks(monkeypatch)
    model = qwen3_vl(mini_sequence_chunk=chunk, streaming_backward_chunk=stream)
    result = composite_step(model, inputs)
    layers = COMMON["num_hidden_layers"]
    # Streamed: every text layer, its MLP unsplit inside the chunks; else each text MLP by mini-sequences.
    assert (len(calls), len(split)) == ((0, layers) if stream is None else (layers, 0))
    assert result[0].logits is None  # the chunked LM head + loss
    assert any("visual.deepstack" in name for name in reference[1]) and any("visual.blocks" in n for n in reference[1])
    assert_same_composite_step(result, reference)


@pytest.mark.parametrize("implementation", ["eager", "flash_attention_2"])
def test_qwen3_vl_streams_with_eager_and_flash_attention(implementation, flash_reference, monkeypatch):
    """Both fields with the text stack's other attention implementations (flash_attention_2: upstream's path with the
    reference kernels of tests/test_streaming.py, each row's padding as its own cu_seq_lens): exact."""
    inputs = qwen3_vl_batch(zlib.crc32(f"qwen3-vl/{implementation}".encode()) % 1000, with_video=True)

    def built(**fields):
        model = qwen3_vl(**fields)
        model.config.text_config._attn_implementation = implementation
        return model

    reference = composite_step(built(), inputs)
    calls = count_streamed_calls(monkeypatch)
    result = composite_step(built(mini_sequence_chunk=4, streaming_backward_chunk=5), inputs)
    assert len(calls) == COMMON["num_hidden_layers"]
    if implementation == "flash_attention_2":
        assert "reference_flash_varlen" in flash_reference.calls
    assert_same_composite_step(result, reference)


@pytest.mark.parametrize(("chunk", "stream"), [(7, None), (4, 5)], ids=str)
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_qwen3_vl_moe_with_images_videos_and_aux_loss(chunk, stream, implementation, monkeypatch):
    """Qwen3-VL-MoE with an image per row and a video, the router's aux loss on (`output_router_logits=True`): its MoE
    block by mini-sequences of tokens (router logits recorded once, whole), and both fields (every text layer
    streamed): the loss with its aux loss, the aux loss itself and every gradient exact."""
    inputs = qwen3_vl_batch(zlib.crc32(f"qwen3-vl-moe/{chunk}/{stream}/{implementation}".encode()) % 1000, True)
    inputs["output_router_logits"] = True

    def built(**fields):
        model = qwen3_vl(moe=True, **fields)
        model.config.text_config._attn_implementation = implementation
        return model

    reference = composite_step(built(), inputs)
    calls, split = count_streamed_calls(monkeypatch), count_split_blocks(monkeypatch)
    result = composite_step(built(mini_sequence_chunk=chunk, streaming_backward_chunk=stream), inputs)
    # Streamed: both text layers, their blocks unsplit inside the chunks; else layer 0's MLP and layer 1's MoE block
    # by mini-sequences.
    streamed = stream is not None
    assert len(calls) == (COMMON["num_hidden_layers"] if streamed else 0)
    assert split == ([] if streamed else ["mini_sequence_mlp", "mini_sequence_moe"])
    assert result[0].logits is None and reference[0].aux_loss is not None
    assert_close(result[0].aux_loss, reference[0].aux_loss, what="aux_loss")
    assert any(".mlp.experts." in name for name in reference[1])
    assert_same_composite_step(result, reference)


# ----------------------------------------------------------------------------- Qwen3.5 with images and videos

# Qwen3.5's and Qwen3.5-MoE's composites around the tiny text stacks of the registry (a Gated DeltaNet layer, then a
# full-attention layer) and Qwen3-VL's tiny vision tower without its deepstack. Their decay parameters' gradients are
# ill-conditioned in fp32 in this model: upstream's own fp32 step is 49% from fp64 for `A_log` (seed 3, text only),
# so they are judged in fp64 throughout, against upstream's fp64 step.
QWEN3_5_DECAY = (*_DECAY, "linear_attn.in_proj_a.weight")
QWEN3_5_VISION = {key: value for key, value in QWEN3_VL_VISION.items() if key != "deepstack_visual_indexes"}


def qwen3_5(seed=0, moe=False, eager_experts=False, **text_overrides):
    """`eager_experts`: the experts by upstream's loop over them (grouped_mm has no fp64 kernel)."""
    vocab = COMMON["vocab_size"]
    text = make_config("qwen3_5_moe_text" if moe else "qwen3_5_text", **text_overrides).to_dict()
    config_class = transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config
    config = config_class(text_config=text, vision_config=QWEN3_5_VISION, image_token_id=VL_IMAGE,
                          video_token_id=VL_VIDEO, vision_start_token_id=vocab - 3, vision_end_token_id=vocab - 4)
    torch.manual_seed(seed)
    model_class = transformers.Qwen3_5MoeForConditionalGeneration if moe else transformers.Qwen3_5ForConditionalGeneration
    model = model_class(config)
    if eager_experts:
        model.set_experts_implementation("eager")
    return model


@pytest.mark.parametrize(("chunk", "stream"), [(7, None), (4, 5)], ids=str)
@pytest.mark.parametrize("moe", [False, True], ids=["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_with_images_and_videos(chunk, stream, moe, monkeypatch):
    """Qwen3.5 as its checkpoints load for images and videos: an image per row, a video in row 0, a left-padded row, the
    MoE one with the router's aux loss: mini-sequences, and both fields (the Gated DeltaNet layer through its state, the
    attention layer by query chunks), exact against the unsplit composite; the decay parameters in fp64."""
    inputs = qwen3_vl_batch(zlib.crc32(f"qwen3.5/{chunk}/{stream}/{moe}".encode()) % 1000, with_video=True)
    if moe:
        inputs["output_router_logits"] = True
    fields = dict(mini_sequence_chunk=chunk, streaming_backward_chunk=stream)
    reference = composite_step(qwen3_5(moe=moe), inputs)
    calls = count_streamed_calls(monkeypatch)
    result = composite_step(qwen3_5(moe=moe, **fields), inputs)
    assert len(calls) == (0 if stream is None else 1)  # the full-attention layer's Function (the other: recurrent.py)
    assert result[0].logits is None and any("visual.blocks" in name for name in reference[1])
    if moe:
        assert reference[0].aux_loss is not None
        assert_close(result[0].aux_loss, reference[0].aux_loss, what="aux_loss")
    assert_same_composite_step(result, reference, fp64_checked=QWEN3_5_DECAY)
    inputs = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in inputs.items()}
    with fp64_throughout("qwen3_5_moe_text" if moe else "qwen3_5_text"):
        fp64 = [composite_step(qwen3_5(moe=moe, eager_experts=True, **extra).double(), inputs)[1]
                for extra in (fields, {})]
    decay = [name for name in fp64[1] if name.endswith(QWEN3_5_DECAY)]
    assert decay
    for name in decay:  # fp64's own rounding of these sums moves them by up to 1.5e-9 (measured)
        assert_close(fp64[0][name], fp64[1][name], rtol=1e-8, what=f"{name} (fp64)")


@pytest.mark.parametrize("composite", ["gemma3", "gemma4", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"])
def test_composite_checkpoint_takes_the_fields_from_from_pretrained(composite, tmp_path, caplog, monkeypatch):
    """What users run: `AutoModelForImageTextToText.from_pretrained(path, mini_sequence_chunk=..., ...)` puts the
    fields on the composite's config, while its text stack and head read its text config: they are carried there
    (until mst.26 they were warned about as ignored on the composite and never applied). The chunked loss runs, every
    text layer streams, and the step equals the checkpoint's loaded without the fields."""
    build = {"gemma3": gemma3_multimodal, "gemma4": gemma4_multimodal, "qwen3_vl": qwen3_vl,
             "qwen3_vl_moe": lambda: qwen3_vl(moe=True), "qwen3_5": qwen3_5,
             "qwen3_5_moe": lambda: qwen3_5(moe=True)}[composite]
    build().save_pretrained(tmp_path)
    input_ids, attention_mask, labels = batch(zlib.crc32(composite.encode()) % 1000, high=COMMON["vocab_size"] - 8)
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    reference = composite_step(transformers.AutoModelForImageTextToText.from_pretrained(tmp_path), inputs)
    calls = count_streamed_calls(monkeypatch)
    with caplog.at_level(logging.WARNING):
        model = transformers.AutoModelForImageTextToText.from_pretrained(
            tmp_path, mini_sequence_chunk=7, streaming_backward_chunk=5
        )
    assert "ignored" not in caplog.text
    text_config = model.config.get_text_config()
    assert (text_config.mini_sequence_chunk, text_config.streaming_backward_chunk) == (7, 5)
    result = composite_step(model, inputs)
    # Qwen3.5's Gated DeltaNet layer streams through recurrent.py's Function; its decay gradients: in fp64 above
    streamed = COMMON["num_hidden_layers"] - composite.startswith("qwen3_5")
    assert result[0].logits is None and len(calls) == streamed
    assert_same_composite_step(result, reference, every_parameter=False,  # no image: the vision tower gets none
                               fp64_checked=QWEN3_5_DECAY if composite.startswith("qwen3_5") else ())


# ----------------------------------------------------------------------------- MoE: the auxiliary loss


def assert_same_aux_loss(family, out, ref):
    """The router aux loss, where the family's head adds one (none for NO_AUX_LOSS, as upstream), equal."""
    assert (ref.aux_loss is None) == (family in NO_AUX_LOSS) == (out.aux_loss is None)
    if ref.aux_loss is not None:
        assert_close(out.aux_loss, ref.aux_loss, what="aux_loss")


@pytest.mark.parametrize("family", MOE_FAMILIES + ("granitemoe", "granitemoeshared"))
@pytest.mark.parametrize("chunk", [1, 7, "auto"], ids=str)
def test_moe_exact_with_router_aux_loss(family, chunk):
    """output_router_logits=True: the loss (LM loss + 1.0 * load-balancing loss over the padded batch's mask), the
    aux loss, each layer's router logits (whole, in upstream's (batch, position) order) and every gradient, the
    routers' included, as the unsplit blocks give. GraniteMoE's blocks run unsplit (only its head is chunked), its
    aux loss added to the chunked loss by upstream's lines."""
    inputs = batch(zlib.crc32(f"moe/{family}/{chunk}".encode()) % 1000)
    reference = train_step(make_model(family), *inputs, output_router_logits=True)
    result = train_step(make_model(family, mini_sequence_chunk=chunk), *inputs, output_router_logits=True)
    assert_same_step(result, reference, FP64_CHECKED.get(family, ()))
    out, ref = result[0], reference[0]
    assert_same_aux_loss(family, out, ref)
    assert len(out.router_logits) == len(ref.router_logits) > 0
    for layer, (logits, ref_logits) in enumerate(zip(out.router_logits, ref.router_logits)):
        assert logits.shape == ref_logits.shape
        assert_close(logits, ref_logits, what=f"router_logits[{layer}]")


def moe_block(model):
    """The last MoE block: the last layer's module with experts and a router (`mlp`, Llama-4's and LFM2-MoE's
    `feed_forward`, the Granite families' `block_sparse_moe`, Nemotron-H's `mixer` on its MoE blocks)."""
    for layer in reversed(model.model.layers):
        for module in layer.modules():
            if hasattr(module, "experts") and (hasattr(module, "router") or hasattr(module, "gate")):
                return module
    raise AssertionError(f"{type(model).__name__} has no MoE block")


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_aux_loss_under_checkpointing(family):
    inputs = batch(21)
    results = []
    for chunk in (None, 7):
        model = make_model(family, mini_sequence_chunk=chunk)
        model.activation_checkpointing_enable()
        results.append(train_step(model, *inputs, output_router_logits=True))
    assert_same_step(results[1], results[0], FP64_CHECKED.get(family, ()))


@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("aux", [False, True], ids=["no_aux", "aux"])
def test_moe_checkpointing_routes_each_token_twice(family, aux, monkeypatch):
    """Under checkpointing the router sees each token twice a step (forward, one rebuild), flag set or not, and with
    the router's output-capturing hook recording logits (aux): the block runs through the MLP's Function, so the
    layer's recompute stops before it. Checkpointed chunks inside the recomputed layer gave 2.875; GraniteMoE-shared's
    and Granite-4.0-H's MoE block and shared MLP chunked by a Function each, 3.0 (the shared MLP saved its input after
    the block ran: `moe_plus_mlp` chunks them together). Counted in the router class's forward (a hook of ours would
    send the block to the wrapper path)."""
    runs = []
    for chunk in (None, 7):
        model = make_model(family, mini_sequence_chunk=chunk, output_router_logits=aux)
        model.activation_checkpointing_enable()
        block = moe_block(model)
        router = block.router if hasattr(block, "router") else block.gate
        original, rows = type(router).forward, [0]

        def counted(module, x, *args, router=router, rows=rows, original=original):  # LFM2-MoE's: an expert bias
            if module is router:
                rows[0] += x.reshape(-1, x.shape[-1]).shape[0]
            return original(module, x, *args)

        monkeypatch.setattr(type(router), "forward", counted)
        input_ids, attention_mask, labels = batch(25)
        step = train_step(model, input_ids, attention_mask, labels)
        runs.append(rows[0] / input_ids.numel())
        monkeypatch.undo()
    assert runs == [2.0, 2.0]
    assert (step[0].aux_loss is not None) == (aux and family not in NO_AUX_LOSS)


# 16 experts, each as large as the dense MLP, in each family's own fields (Mixtral's and GPT-OSS's by default).
_ROUTED_16 = dict(n_routed_experts=16, moe_intermediate_size=256)
LARGE_EXPERTS = {"olmoe": dict(num_experts=16),
                 **dict.fromkeys(("qwen3_moe", "lfm2_moe", "kimi_linear"),
                                 dict(num_experts=16, moe_intermediate_size=256)),
                 **dict.fromkeys(("deepseek_v2", "deepseek_v3", "glm4_moe", "glm4_moe_lite", "deepseek_v32",
                                  "glm_moe_dsa", "nemotron_h"), _ROUTED_16)}


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_function_backward_peak_at_most_the_checkpointed_chunks(family):
    """bf16, experts large against the activations: the backward peak of a block through the Function (its expert
    gradients summed in their own dtype, each added as soon as autograd computes it: `summed_as_computed`) is no
    higher than that of the same chunks under checkpointing, where autograd sums them (a forward pre-hook of the
    test's sends the block there). Gradients equal too. Holding each chunk's gradients until `autograd.grad`
    returned, with the sum beside them, was 1.3x that peak (Mixtral, 38.7 vs 29.3 MiB)."""
    from transformers.mst_core.memory import LiveTensorTracker

    experts = LARGE_EXPERTS.get(family, dict(num_local_experts=16))
    model = make_model(family, mini_sequence_chunk=64, hidden_size=128, intermediate_size=256, **experts)
    block = moe_block(model).to(torch.bfloat16)
    x = torch.randn(1, 512, 128, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(3))
    results = []
    for wrapped in (False, True):
        handle = block.register_forward_pre_hook(lambda module, args: None) if wrapped else None
        block.zero_grad(set_to_none=True)
        inputs = x.clone().requires_grad_()
        out = block(inputs)
        out = out[0] if isinstance(out, tuple) else out
        node = out.grad_fn
        if type(node).__name__ == "ViewBackward0":  # Llama-4's block returns its output as [tokens, d]
            node = node.next_functions[0][0]
        assert (type(node).__name__ == "_MiniSequenceMLPFunctionBackward") != wrapped
        with LiveTensorTracker() as tracker:
            start = tracker.current_bytes
            out.backward(torch.ones_like(out))
        results.append((tracker.peak_bytes - start, inputs.grad, {n: p.grad for n, p in block.named_parameters()}))
        if handle is not None:
            handle.remove()
    (function_peak, x_grad, grads), (checkpointed_peak, ref_x_grad, ref_grads) = results
    assert function_peak <= checkpointed_peak, (function_peak, checkpointed_peak)
    for name, grad, ref in [("x", x_grad, ref_x_grad)] + [(n, grads[n], g) for n, g in ref_grads.items()]:
        error = ((grad.float() - ref.float()).norm() / ref.float().norm()).item()
        assert error < 1e-2, (name, error)  # bf16 sums in other orders (autograd's runs the chunks last to first)


def test_moe_router_jitter_runs_the_block_unsplit(caplog):
    """Jitter noise draws per call: chunks would draw other noise than the whole sequence, so the block runs
    unsplit (a warning says so) and the step matches upstream's with the same seed."""
    inputs = batch(22)
    results = []
    for chunk in (None, 7):
        model = make_model("mixtral", mini_sequence_chunk=chunk, router_jitter_noise=0.1)
        torch.manual_seed(5)
        with caplog.at_level(logging.WARNING):
            results.append(train_step(model, *inputs))
    assert "router_jitter_noise=0.1 in training; the MoE blocks run unsplit" in caplog.text
    assert_same_step(results[1], results[0])


def test_gemma3_conditional_generation_with_images():
    """Images in the batch (4 image tokens per row, bidirectional among themselves): the vision tower and projector
    (upstream, unsplit) get the same gradients too."""
    input_ids, attention_mask, labels = batch(31, high=COMMON["vocab_size"] - 3)
    image_token = COMMON["vocab_size"] - 1
    input_ids[:, 10:14] = image_token
    labels[:, 10:14] = -100
    token_type_ids = (input_ids == image_token).long()
    pixel_values = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(31))
    step = dict(embeds=False, pixel_values=pixel_values, token_type_ids=token_type_ids)
    reference = train_step(gemma3_multimodal(), input_ids, attention_mask, labels, **step)
    result = train_step(gemma3_multimodal(mini_sequence_chunk=7), input_ids, attention_mask, labels, **step)
    assert result[0].logits is None
    assert any("vision_tower" in name for name in reference[1])
    assert_same_step(result, reference)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_block_runs_per_mini_sequence(family):
    """The block's own forward runs per chunk: its router sees at most `chunk` tokens of each row at a time, every
    token once in the forward and once in the chunk's recompute in backward (only the chunk's input was kept)."""
    chunk = 7
    model = make_model(family, mini_sequence_chunk=chunk)
    block = moe_block(model)
    router = block.router if hasattr(block, "router") else block.gate
    seen = []
    # DeepSeek's routers take [batch, chunk, d] and flatten it themselves
    router.register_forward_hook(lambda module, args, output: seen.append(args[0].shape[:-1].numel()))
    input_ids, attention_mask, labels = batch(23)
    train_step(model, input_ids, attention_mask, labels, output_router_logits=True)
    bsz = input_ids.shape[0]
    assert max(seen) <= bsz * chunk and sum(seen) == 2 * input_ids.numel()


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_eval_router_logits_whole(family):
    """Without gradients (eval under no_grad) the chunks run in a plain loop; the router logits still come back
    whole."""
    ids, mask, labels = batch(24)
    with torch.no_grad():
        ref = make_model(family).eval()(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True)
        out = make_model(family, mini_sequence_chunk=7).eval()(
            input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True
        )
    assert_close(out.logits, ref.logits, what="logits")
    assert_same_aux_loss(family, out, ref)
    assert [r.shape for r in out.router_logits] == [r.shape for r in ref.router_logits]
    for logits, ref_logits in zip(out.router_logits, ref.router_logits):
        assert_close(logits, ref_logits, what="router_logits")


# ----------------------------------------------------------------------------- Qwen3.5


QWEN3_5_CHECKPOINTS = {  # family: (composite config class, composite model class, the text model AutoModelForCausalLM builds)
    "qwen3_5_text": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM"),
    "qwen3_5_moe_text": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM"),
}


@pytest.mark.parametrize("family", sorted(QWEN3_5_CHECKPOINTS))
def test_qwen3_5_composite_config_through_auto_model_for_causal_lm_from_config(family):
    """`AutoModelForCausalLM.from_config(composite config)` builds the text model from the text config: a field set on
    the composite's config reaches it (patch 0014's first site in auto_factory.py; upstream dropped it)."""
    config_class, _, text_class = QWEN3_5_CHECKPOINTS[family]
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=COMMON["hidden_size"])
    config = getattr(transformers, config_class)(text_config={**COMMON, **NEW_FAMILIES[family][2]},
                                                 vision_config=vision, mini_sequence_chunk=7)
    assert config.get_text_config().mini_sequence_chunk is None
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert type(model).__name__ == text_class and model.config.mini_sequence_chunk == 7


@pytest.mark.parametrize("family", sorted(QWEN3_5_CHECKPOINTS))
def test_qwen3_5_checkpoint_through_auto_model_for_causal_lm(family, tmp_path, caplog):
    """What a Qwen3.5 user runs: a `qwen3_5` / `qwen3_5_moe` (multimodal) checkpoint loaded by AutoModelForCausalLM,
    which builds the text stack (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM), with `from_pretrained(path,
    mini_sequence_chunk=...)`. The chunked loss runs (no logits) and equals the unset step with the Trainer's
    gradient-accumulation divisor (`num_items_in_batch`); with `streaming_backward_chunk` too, its linear-attention
    layers stream through their state and its attention layers by query chunks (since 5.24.0+mst.30), no warning."""
    config_class, composite_class, text_class = QWEN3_5_CHECKPOINTS[family]
    text = {**COMMON, **NEW_FAMILIES[family][2]}
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=COMMON["hidden_size"])
    torch.manual_seed(0)
    getattr(transformers, composite_class)(
        getattr(transformers, config_class)(text_config=text, vision_config=vision)).save_pretrained(tmp_path)
    inputs = batch(31)

    def step(**fields):
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, **fields)
        assert type(model).__name__ == text_class
        return train_step(model, *inputs, num_items_in_batch=torch.tensor(97))

    reference = step()
    result = step(mini_sequence_chunk=7)
    assert result[0].logits is None and reference[0].logits is not None
    assert_same_step(result, reference)
    from transformers.streaming_backward import layer as streamed_layer
    from transformers.streaming_backward import recurrent

    calls = []
    with (caplog.at_level(logging.WARNING),
          pytest.MonkeyPatch.context() as patch):
        for function in (recurrent.StreamedRecurrentFunction, streamed_layer.StreamedLayerFunction):
            patch.setattr(function, "apply", lambda *args, real=function.apply: calls.append(1) or real(*args))
        streamed = step(mini_sequence_chunk=7, streaming_backward_chunk=4)
    assert "streaming_backward_chunk" not in caplog.text
    assert len(calls) == 2  # both layers streamed
    # The decay's parameters (and Qwen3.5's unfused `in_proj_a`, which feeds it) move by fp32 rounding alone beyond
    # RTOL when the scan runs by chunks: tests/test_streaming_recurrent.py compares them with the unsplit step, in
    # fp64 throughout where fp32 rounding alone moves them beyond its tolerance.
    assert_same_step(streamed, result, fp64_checked=(*_DECAY, "linear_attn.in_proj_a.weight"))

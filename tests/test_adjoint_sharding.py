"""Adjoint sharding (docs/adjoint-sharding.md) on Mamba and FalconMamba: the flags, exactness against upstream's torch
scan, truncation against a brute-force reference, unchanged eval/generation, and memory.

Model comparisons build the same tiny model twice from one seed (flags off = upstream's path, and
on), feed both the same fresh random batch (left padding on one row, ignored labels, one row fully
ignored) and compare the loss, every parameter's gradient and the gradient of `inputs_embeds`.
"""

import copy

import pytest
import torch
import transformers
from test_mini_sequence_models import assert_close, batch, train_step
from test_streaming import assert_bf16_as_accurate_as_upstream, seed_of
from tiny_models import SSM_FAMILIES, make_config, make_model
from transformers.adjoint_sharding import config as adjoint_config
from transformers.adjoint_sharding import scan
from transformers.mst_core.memory import LiveTensorTracker
from transformers.models.falcon_mamba import modeling_falcon_mamba
from transformers.models.mamba import modeling_mamba

SEQ = 40
SHARDS = [1, 7, 64, SEQ - 1, SEQ + 5, "auto"]
FAMILY_NAMES = sorted(SSM_FAMILIES)
MODELING = {"mamba": modeling_mamba, "falcon_mamba": modeling_falcon_mamba}


def compare_adjoint(family, seed, inputs=None, prepare=None, rtol=1e-5, **flags):
    """Flags off vs `flags`; returns the flagged run's output."""
    inputs = inputs if inputs is not None else batch(seed)
    (ref, ref_grads, ref_embeds), (out, grads, embeds) = [
        train_step(prepare(model) if prepare else model, *inputs)
        for model in (make_model(family), make_model(family, **flags))
    ]
    assert_close(out.loss, ref.loss, rtol, "loss")
    assert grads.keys() == ref_grads.keys() and len(ref_grads) == len(list(make_model(family).parameters()))
    for name in ref_grads:
        assert_close(grads[name], ref_grads[name], rtol, name)
    assert_close(embeds, ref_embeds, rtol, "inputs_embeds")
    return out


@pytest.fixture
def scan_calls(monkeypatch):
    """Counts forwards of the adjoint scan Function and calls of upstream's scan."""
    calls = {"adjoint": 0, "upstream": 0}
    adjoint_forward = scan.AdjointSelectiveScan.forward

    def counted_adjoint(*args, **kwargs):
        calls["adjoint"] += 1
        return adjoint_forward(*args, **kwargs)

    def counted(upstream_scan):
        def counted_upstream(*args, **kwargs):
            calls["upstream"] += 1
            return upstream_scan(*args, **kwargs)
        return counted_upstream

    monkeypatch.setattr(scan.AdjointSelectiveScan, "forward", staticmethod(counted_adjoint))
    for module in MODELING.values():
        monkeypatch.setattr(module, "mamba_selective_scan", counted(module.mamba_selective_scan))
    return calls


# ----------------------------------------------------------------------------- the flags


@pytest.mark.parametrize("family", FAMILY_NAMES)
@pytest.mark.parametrize("bad", [0, -3, 4.0, True, "Auto", "", [8]])
def test_bad_chunk_rejected_at_construction(family, bad):
    with pytest.raises(ValueError, match=r"adjoint_sharding_chunk.*None, \"auto\", or a positive int"):
        make_config(family, adjoint_sharding_chunk=bad)
    with pytest.raises(ValueError, match=r"mini_sequence_chunk.*None, \"auto\", or a positive int"):
        make_config(family, mini_sequence_chunk=bad)


@pytest.mark.parametrize("family", FAMILY_NAMES)
@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "auto", "8"])
def test_bad_truncation_rejected_at_construction(family, bad):
    with pytest.raises(ValueError, match=r"adjoint_truncation.*None \(exact gradients\) or a positive int"):
        make_config(family, adjoint_sharding_chunk=8, adjoint_truncation=bad)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_truncation_needs_sharding(family):
    with pytest.raises(ValueError, match=r"adjoint_truncation.*needs `adjoint_sharding_chunk`"):
        make_config(family, adjoint_truncation=16)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_flags_saved_and_reloaded(family, tmp_path):
    make_config(family, adjoint_sharding_chunk=96, adjoint_truncation=12, mini_sequence_chunk="auto").save_pretrained(tmp_path)
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    assert (config.adjoint_sharding_chunk, config.adjoint_truncation, config.mini_sequence_chunk) == (96, 12, "auto")
    config = make_config(family)
    assert (config.adjoint_sharding_chunk, config.adjoint_truncation, config.mini_sequence_chunk) == (None, None, None)


def test_auto_shard_policy():
    assert adjoint_config.shard_tokens("auto") == adjoint_config.AUTO_SHARD_TOKENS
    assert adjoint_config.shard_tokens(7) == 7


def test_flag_assigned_after_construction_is_checked_at_use():
    model = make_model("mamba", adjoint_sharding_chunk=8).train()
    model.config.adjoint_sharding_chunk = 2.5
    with pytest.raises(ValueError, match="adjoint_sharding_chunk"):
        model(input_ids=torch.ones(1, 12, dtype=torch.long), labels=torch.ones(1, 12, dtype=torch.long))


# ----------------------------------------------------------------------------- exactness, fp32


@pytest.mark.parametrize("family", FAMILY_NAMES)
@pytest.mark.parametrize("shard", SHARDS, ids=str)
def test_exact_against_upstream_scan(family, shard, scan_calls):
    """Batch 3: left padding (attention_mask) on one row, ignored labels, one row fully ignored."""
    out = compare_adjoint(family, seed_of(family, shard), adjoint_sharding_chunk=shard)
    layers = make_config(family).num_hidden_layers
    assert scan_calls == {"adjoint": layers, "upstream": layers}  # flag-on model: ours; flag-off: upstream's
    assert out.logits is not None  # mini_sequence_chunk not set: upstream's LM head


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_exact_with_mini_sequence_lm_head(family):
    out = compare_adjoint(family, seed_of(family, "lm"), adjoint_sharding_chunk=9, mini_sequence_chunk=8)
    assert out.logits is None  # the LM head + loss ran chunk by chunk


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_mini_sequence_lm_head_alone(family):
    """mini_sequence_chunk alone on a Mamba config: chunked LM head + loss, exact."""
    out = compare_adjoint(family, seed_of(family, "lm-only"), mini_sequence_chunk=16)
    assert out.logits is None


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_exact_with_gradient_checkpointing(family, scan_calls):
    out = compare_adjoint(
        family, seed_of(family, "gc"), prepare=lambda m: m.gradient_checkpointing_enable() or m,
        adjoint_sharding_chunk=7, mini_sequence_chunk=8,
    )
    layers = make_config(family).num_hidden_layers
    assert out.logits is None
    assert scan_calls["adjoint"] == 2 * layers  # forward, and the checkpoint's recompute


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_exact_with_truncation_at_least_the_sequence(family):
    """adjoint_truncation >= S keeps every transition: the exact gradient."""
    compare_adjoint(family, seed_of(family, "T>=S"), adjoint_sharding_chunk=6, adjoint_truncation=SEQ)


def test_gradient_accumulation_over_two_batches():
    """Two backwards into the same .grad (gradient accumulation) equal upstream's sums."""
    grads = []
    for flags in ({}, {"adjoint_sharding_chunk": 5}):
        model = make_model("mamba", **flags).train()
        for seed in (3, 4):
            ids, mask, labels = batch(seed)
            model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in grads[0]:
        assert_close(grads[1][name], grads[0][name], what=name)


# ----------------------------------------------------------------------------- the scan alone


def scan_inputs(seed, dtype=torch.float64, batch_size=2, channels=6, states=4, seq=37):
    gen = torch.Generator().manual_seed(seed)
    shapes = {"u": (batch_size, channels, seq), "dt": (batch_size, channels, seq), "A": (channels, states),
              "B": (batch_size, states, seq), "C": (batch_size, states, seq), "bias": (channels,)}
    values = {name: torch.randn(shape, generator=gen, dtype=torch.float64) for name, shape in shapes.items()}
    values["A"] = -torch.exp(values["A"])
    values["dt"] = values["dt"] - 1.0
    return {name: v.to(dtype).requires_grad_() for name, v in values.items()}


def brute_force_truncated(u, dt, A, B, C, bias, truncation):
    """Each output y[t] recomputed from h[t - T] taken as a constant, through the last T transitions."""
    delta = torch.nn.functional.softplus(dt + bias[:, None])
    a = torch.exp(delta[..., None] * A[None, :, None, :])  # [b, d, S, n]
    b_terms = (delta * u)[..., None] * B.transpose(1, 2)[:, None]
    seq = u.shape[-1]
    with torch.no_grad():
        states, h = [], torch.zeros_like(a[:, :, 0])
        for t in range(seq):
            h = a[:, :, t] * h + b_terms[:, :, t]
            states.append(h)
    outputs = []
    for t in range(seq):
        h = states[t - truncation] if t >= truncation else torch.zeros_like(a[:, :, 0])
        for i in range(max(0, t - truncation + 1), t + 1):
            h = a[:, :, i] * h + b_terms[:, :, i]
        outputs.append((h * C[:, None, :, t]).sum(-1))
    return torch.stack(outputs, -1)


def scan_grads(inputs, function, grad_output):
    function(**inputs).backward(grad_output)
    return {name: v.grad for name, v in inputs.items()}


def adjoint(shard, truncation=None):
    def run(u, dt, A, B, C, bias):
        return scan.selective_scan(u, dt, A, B, C, delta_bias=bias, delta_softplus=True, shard=shard, truncation=truncation)
    return run


@pytest.mark.parametrize("shard", [1, 4, 36, 64])
def test_scan_matches_upstream_in_fp64(shard):
    """Our fp32 scan against upstream's scan run in fp64, with the D skip and the gate."""
    grad_output = torch.randn(2, 6, 37, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    extra = {"D": torch.randn(6, dtype=torch.float64), "z": torch.randn(2, 6, 37, dtype=torch.float64)}

    def upstream(u, dt, A, B, C, bias):
        return modeling_mamba.mamba_selective_scan(u, dt, A, B, C, D=extra["D"], z=extra["z"], delta_bias=bias, delta_softplus=True)

    def ours(u, dt, A, B, C, bias):
        return scan.selective_scan(u, dt, A, B, C, D=extra["D"].float(), z=extra["z"].float(), delta_bias=bias,
                                   delta_softplus=True, shard=shard)

    ref = scan_grads(scan_inputs(1), upstream, grad_output)
    got = scan_grads(scan_inputs(1, torch.float32), ours, grad_output.float())
    for name in ref:
        assert_close(got[name], ref[name], 1e-5, name)


@pytest.mark.parametrize("truncation", [1, 3, 8])
@pytest.mark.parametrize("shard", [1, 5, 64])
def test_truncated_matches_brute_force(truncation, shard):
    grad_output = torch.randn(2, 6, 37, dtype=torch.float64, generator=torch.Generator().manual_seed(truncation))
    ref = scan_grads(scan_inputs(2), lambda **k: brute_force_truncated(**k, truncation=truncation), grad_output)
    got = scan_grads(scan_inputs(2, torch.float32), adjoint(shard, truncation), grad_output.float())
    exact = scan_grads(scan_inputs(2, torch.float32), adjoint(shard), grad_output.float())
    for name in ref:
        assert_close(got[name], ref[name], 1e-5, name)
    # The truncation changes the gradients (else this test could not tell it from the exact scan).
    changed = max(((exact[n] - got[n]).norm() / exact[n].norm()).item() for n in ("u", "dt", "A", "B"))
    assert changed > 1e-2, f"truncated gradients differ from exact ones by only {changed:.1e}"


def test_initial_and_last_state_gradients():
    """The state entering the scan and the state it returns are differentiable (for sequence sharding
    across processes): against autograd through upstream's loop in fp64, with a loss on both."""
    gen = torch.Generator().manual_seed(4)
    inputs64 = scan_inputs(3)
    h0 = torch.randn(2, 6, 4, dtype=torch.float64, generator=gen).requires_grad_()
    weight = torch.randn(2, 6, 4, dtype=torch.float64, generator=gen)
    grad_output = torch.randn(2, 6, 37, dtype=torch.float64, generator=gen)
    u, dt, A, B, C, bias = inputs64.values()
    delta = torch.nn.functional.softplus(dt + bias[:, None])
    h, outputs = h0, []
    for t in range(37):
        h = torch.exp(delta[:, :, t, None] * A) * h + (delta[:, :, t] * u[:, :, t])[..., None] * B[:, None, :, t]
        outputs.append((h * C[:, None, :, t]).sum(-1))
    ((torch.stack(outputs, -1) * grad_output).sum() + (h * weight).sum()).backward()
    inputs32 = scan_inputs(3, torch.float32)
    h0_32 = h0.detach().float().requires_grad_()
    u, dt, A, B, C, bias = inputs32.values()
    y, last = scan.selective_scan(u, dt, A, B, C, delta_bias=bias, delta_softplus=True, return_last_state=True,
                                  shard=5, initial_state=h0_32)
    ((y * grad_output.float()).sum() + (last * weight.float()).sum()).backward()
    assert_close(h0_32.grad, h0.grad, 1e-5, "initial state")
    for name, value in inputs64.items():
        assert_close(inputs32[name].grad, value.grad, 1e-5, name)


@pytest.mark.parametrize("length", [1, 2, 15, 16, 17, 100])
def test_linear_scan_against_a_loop(length):
    gen = torch.Generator().manual_seed(length)
    a, b = torch.rand(length, 3, 2, generator=gen), torch.randn(length, 3, 2, generator=gen)
    initial = torch.randn(3, 2, generator=gen)
    h, expected = initial, []
    for t in range(length):
        h = a[t] * h + b[t]
        expected.append(h)
    torch.testing.assert_close(scan.linear_scan(a, b, initial), torch.stack(expected), rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- bf16


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_bf16_as_accurate_as_upstream(family):
    assert_bf16_as_accurate_as_upstream(family, adjoint_sharding_chunk=9)


# ----------------------------------------------------------------------------- unchanged paths


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_eval_and_generate_unchanged(family, scan_calls):
    ids, mask, _ = batch(5)
    results = []
    for flags in ({}, {"adjoint_sharding_chunk": 4, "adjoint_truncation": 2, "mini_sequence_chunk": 4}):
        model = make_model(family, **flags).eval()
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits
        generated = model.generate(ids[:1, :10], max_new_tokens=6, do_sample=False)
        model.train()
        with torch.no_grad():  # training mode without gradients: nothing to shard
            train_logits = model(input_ids=ids, attention_mask=mask).logits
        results.append((logits, generated, train_logits))
    for ref, ours in zip(*results):
        assert torch.equal(ref, ours)
    assert scan_calls["adjoint"] == 0


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_fused_kernel_not_taken_when_flag_set(family, monkeypatch):
    """With mamba_ssm kernels installed the mixer would return the fused kernel's output in training
    and ignore the flag: with the flag set it must not call the fused function."""
    module = MODELING[family]
    called = []
    monkeypatch.setattr(module, "mamba_inner_fn", lambda *a, **k: called.append(1))  # returns None: falls back
    ids, mask, labels = batch(6)
    for flags, expected in (({}, 2), ({"adjoint_sharding_chunk": 8}, 0)):
        called.clear()
        make_model(family, **flags).train()(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        assert len(called) == expected, flags


# ----------------------------------------------------------------------------- memory


def test_no_full_state_tensor_with_the_flag():
    """Upstream's torch scan allocates [batch, d, S, n] tensors (a, b-terms, states); with the flag the
    largest scan tensor is one shard's [shard, batch, d, n]."""
    seq, shard = 96, 16
    config = make_config("mamba")
    full = 2 * config.intermediate_size * seq * config.state_size
    largest = {}
    for flags in ({}, {"adjoint_sharding_chunk": shard}):
        model = make_model("mamba", **flags).train()
        ids = torch.randint(1, 128, (2, seq), generator=torch.Generator().manual_seed(0))
        with LiveTensorTracker(keep_largest=50) as tracker:
            model.backbone(input_ids=ids).last_hidden_state.sum().backward()
        largest[bool(flags)] = max(numel for numel, shape, _ in tracker.largest_shapes if len(shape) == 4)
    assert largest[False] >= full  # the test can see the full tensor when it is there
    assert largest[True] <= full * shard / seq, largest


def test_copy_keeps_flags():
    model = make_model("mamba", adjoint_sharding_chunk=5, adjoint_truncation=3)
    assert copy.deepcopy(model).config.adjoint_truncation == 3


def test_flags_on_a_model_without_the_path_warn(caplog):
    """adjoint_sharding_chunk on a transformer config is kept as an attribute but would do nothing: say so."""
    import logging

    transformers.logging.enable_propagation()
    with caplog.at_level(logging.WARNING):
        make_model("llama", adjoint_sharding_chunk=8)
    assert "model_type='llama' has no adjoint_sharding_chunk path: adjoint_sharding_chunk=8 is ignored" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        make_model("mamba", mini_sequence_chunk=8)  # chunks its LM head: no warning
    assert "path" not in caplog.text


def test_sequence_sharding_refuses_what_it_cannot_do():
    from transformers.adjoint_sharding import sequence

    with pytest.raises(ValueError, match="needs adjoint sharding: set `adjoint_sharding_chunk`"):
        sequence.shard_sequence(make_model("mamba"))
    with pytest.raises(ValueError, match="does not support `adjoint_truncation`"):
        sequence.shard_sequence(make_model("mamba", adjoint_sharding_chunk=4, adjoint_truncation=3))
    model = make_model("mamba", adjoint_sharding_chunk=4)
    model.gradient_checkpointing_enable()
    with pytest.raises(ValueError, match="does not support gradient checkpointing"):
        sequence.shard_sequence(model)


def test_double_backward_refused():
    inputs = scan_inputs(5, torch.float32)
    y = adjoint(7)(**inputs)
    with pytest.raises(RuntimeError, match="create_graph=True.*unset adjoint_sharding_chunk"):
        torch.autograd.grad(y.square().sum(), inputs["u"], create_graph=True)

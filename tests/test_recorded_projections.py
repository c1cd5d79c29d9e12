"""streaming_backward/projections.py: a projection's output recorded by the backward's K/V pass and handed back,
with a linear layer's gradients, in the chunk's recompute. The layer-level exactness and counts are in
tests/test_streaming_families.py (test_recomputed_keys_values_exact_and_counted); here the pieces, against
`F.linear` under autograd."""

import pytest
import torch
import torch.nn.functional as F
from transformers.mst_core.grads import LinearWeightGradsSummed
from transformers.streaming_backward.projections import (
    RecordedProjections,
    recordable_projections,
    replayed_linear,
)


def grads_of(fn, x, weight, bias, grad):
    x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
    bias = None if bias is None else bias.detach().requires_grad_()
    out = fn(x, weight, bias)
    leaves = [t for t in (x, weight, bias) if t is not None]
    return (out, *torch.autograd.grad(out, leaves, grad))


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("autocast", [False, True])
def test_replayed_linear_has_the_linear_layers_gradients(with_bias, autocast):
    """fp32 weights, a [B, C, in] input; under bf16 autocast too (the casts on the graph, as autocast's)."""
    gen = torch.Generator().manual_seed(11 + with_bias + 2 * autocast)
    x, weight = torch.randn(2, 5, 8, generator=gen), torch.randn(12, 8, generator=gen)
    bias = torch.randn(12, generator=gen) if with_bias else None
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        with torch.no_grad():
            recorded = F.linear(x, weight, bias)
        grad = torch.randn(recorded.shape, generator=gen).to(recorded.dtype)
        expected = grads_of(F.linear, x, weight, bias, grad)
        got = grads_of(lambda *a: replayed_linear(*a, recorded), x, weight, bias, grad)
    for e, g in zip(expected, got):
        assert g.dtype == e.dtype and g.shape == e.shape
        if autocast:  # bf16 products: within one bf16 rounding of the computed linear's (equal on this machine)
            assert (g.float() - e.float()).abs().max() <= e.float().abs().max() * 2**-8
        else:  # the same products in fp32
            torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6)


def test_replayed_linear_weight_gradient_taken_into_fp32_sums():
    """A bf16 weight that LinearWeightGradsSummed takes: its gradient lands in the fp32 sums as for a computed
    `F.linear` under the same mode, and autograd gets none for it."""
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(12, 8, generator=gen).bfloat16().requires_grad_()
    x = torch.randn(3, 4, 8, generator=gen).bfloat16().requires_grad_()
    grad = torch.randn(3, 4, 12, generator=gen).bfloat16()
    with torch.no_grad():
        recorded = F.linear(x, weight)
    results = []
    for replay in (False, True):
        sums = [None]
        mode = LinearWeightGradsSummed(sums, [weight])
        with mode:
            out = replayed_linear(x, weight, None, recorded, mode) if replay else F.linear(x, weight)
        grad_x, grad_weight = torch.autograd.grad(out, [x, weight], grad, allow_unused=True)
        assert grad_weight is None and mode.seen == {0} and sums[0].dtype == torch.float32
        results.append((out, grad_x, sums[0]))
    for computed, replayed in zip(*results):
        torch.testing.assert_close(replayed, computed, rtol=0, atol=0)


def test_taken_linear_output_takes_an_in_place_add():
    """Under LinearWeightGradsSummed (a chunk's recompute in a Function's backward) a linear layer's output is a tensor
    of its own, which upstream code may add into in place: Llama-4's MoE block does `out = shared_expert(x);
    out.add_(routed)`, and autograd refused that on the identity Function's view the mode returned until mst.25
    (RuntimeError on a GPU, where the mode is on in bf16). The weight's gradient lands in the fp32 sum, the input's and
    the bias's are the linear layer's: against fp64, within bf16's rounding."""
    gen = torch.Generator().manual_seed(7)
    layer = torch.nn.Linear(8, 12).bfloat16()
    x = torch.randn(3, 4, 8, generator=gen).bfloat16().requires_grad_()
    routed = torch.randn(3, 4, 12, generator=gen).bfloat16()
    grad = torch.randn(3, 4, 12, generator=gen).bfloat16()
    sums = [None]
    mode = LinearWeightGradsSummed(sums, [layer.weight, layer.bias])
    with mode:
        out = layer(x)
        out.add_(routed)
    grad_x, grad_bias = torch.autograd.grad(out, [x, layer.bias], grad)
    assert mode.seen == {0} and sums[0].dtype == torch.float32
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, layer.weight, layer.bias))
    want = torch.autograd.grad(F.linear(x64, w64, b64) + routed.double(), [x64, w64, b64], grad.double())
    for got, expected in zip((grad_x, sums[0], grad_bias), want):
        assert (got.double() - expected).abs().max() <= expected.abs().max() * 2**-7


@pytest.mark.parametrize("taken", [False, True])
def test_replayed_linear_output_takes_an_in_place_add(taken):
    """A replayed projection's output is a tensor of its own, as a computed linear's is: upstream code may write into a
    q/k/v projection's output in place, which autograd refused on the custom Function's view returned until mst.26.
    Its gradients are those of the computed linear followed by the same add, with the weight's in the fp32 sums when
    LinearWeightGradsSummed takes it."""
    gen = torch.Generator().manual_seed(13 + taken)
    dtype = torch.bfloat16 if taken else torch.float32
    layer = torch.nn.Linear(8, 12).to(dtype)
    x = torch.randn(3, 4, 8, generator=gen).to(dtype).requires_grad_()
    added, grad = (torch.randn(3, 4, 12, generator=gen).to(dtype) for _ in range(2))
    with torch.no_grad():
        recorded = layer(x)
    sums = [None]
    mode = LinearWeightGradsSummed(sums, [layer.weight, layer.bias]) if taken else None
    out = replayed_linear(x, layer.weight, layer.bias, recorded, mode)
    out.add_(added)
    got = torch.autograd.grad(out, [x, layer.weight, layer.bias], grad, allow_unused=True)
    if taken:
        assert got[1] is None and mode.seen == {0} and sums[0].dtype == torch.float32
        got = (got[0], sums[0], got[2])
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, layer.weight, layer.bias))
    want = torch.autograd.grad(F.linear(x64, w64, b64) + added.double(), [x64, w64, b64], grad.double())
    tolerance = 2**-7 if taken else 1e-6
    for g, expected in zip(got, want):
        assert (g.double() - expected).abs().max() <= expected.abs().max() * tolerance


class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.o_proj = (torch.nn.Linear(8, 8) for _ in range(3))

        class Subclassed(torch.nn.Linear):
            def forward(self, x):
                return super().forward(x) * 2

        self.v_proj = Subclassed(8, 8)
        self.hooked = torch.nn.Linear(8, 8)
        self.hooked.register_forward_hook(lambda *args: None)


def test_only_plain_linears_are_recorded():
    attn = Attention()
    assert recordable_projections(attn) == [attn.q_proj, attn.k_proj, attn.o_proj]
    assert recordable_projections(attn, skipped=attn.q_proj) == [attn.k_proj, attn.o_proj]


def test_replay_returns_the_record_and_computes_what_changed_since(monkeypatch):
    """A module returns its recorded output (no product computed); a record that upstream code wrote into in place
    (its version counter moved) or a call beyond what was recorded is computed as usual; release frees the chunk."""
    attn = Attention()
    projections = RecordedProjections([attn.k_proj])
    x = torch.randn(2, 3, 8)
    with torch.no_grad(), projections.recording(0):
        first = attn.k_proj(x)
    assert "forward" not in vars(attn.k_proj)
    computed = []
    original = torch.nn.Linear.forward
    monkeypatch.setattr(torch.nn.Linear, "forward", lambda m, x: computed.append(m) or original(m, x))
    with projections.replaying(0):
        replayed = attn.k_proj(x)
        again = attn.k_proj(x)  # one call recorded: the second is computed
    assert computed == [attn.k_proj] and torch.equal(replayed, first) and torch.equal(again, first)
    first.mul_(2)  # written in place (e.g. by the first replay's reader)
    computed.clear()
    with projections.replaying(0):
        fresh = attn.k_proj(x)
    assert computed == [attn.k_proj] and torch.equal(fresh, original(attn.k_proj, x))
    projections.release(0)
    computed.clear()
    with projections.replaying(0):
        attn.k_proj(x)
    assert computed == [attn.k_proj] and "forward" not in vars(attn.k_proj)

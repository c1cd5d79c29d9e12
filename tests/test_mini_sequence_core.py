"""Core algorithms of transformers-mst: mini-sequence MLP, mini-sequence LM-head loss, the
config value validation and the live-tensor memory tracker.

Every numerical test compares against the unsplit upstream computation (the upstream MLP
module's forward, upstream ``ForCausalLMLoss`` on full logits) with fresh random inputs.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.utils._python_dispatch import TorchDispatchMode

from transformers import Gemma2Config, LlamaConfig
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.mini_sequence import lm_head_chunk_size, mini_sequence_causal_lm_loss, mini_sequence_mlp, mlp_chunk_size
from transformers.mini_sequence.config import AUTO_MAX_LM_HEAD_LOGITS, AUTO_MIN_LM_HEAD_TOKENS
from transformers.mini_sequence import loss as ms_loss
from transformers.mst_core import grads as core_grads
from transformers.mst_core.fields import validate_mini_sequence_chunk
from transformers.mst_core.memory import LiveTensorTracker
from transformers.mini_sequence.mlp import _MiniSequenceMLPFunction
from transformers.models.gemma2.modeling_gemma2 import Gemma2MLP
from transformers.models.llama.modeling_llama import LlamaMLP


D, I, V = 32, 64, 96
S = 40
CHUNKS = [1, 7, 16, S - 1, S + 5]


def assert_rel_close(actual, expected, rtol=1e-5, what=""):
    """Relative error against the scale of ``expected`` (elementwise, normalised by max |expected|)."""
    assert actual.shape == expected.shape, what
    assert actual.dtype == expected.dtype, what
    a, e = actual.double(), expected.double()
    scale = e.abs().max().clamp(min=1e-30)
    err = ((a - e).abs().max() / scale).item()
    assert err <= rtol, f"{what}: relative error {err:.3g} > {rtol}"


# bf16: ours may be at most this factor less accurate than upstream's own bf16 computation, both
# measured against fp64 from the same bf16 inputs and weights (relative norm errors). Measured
# (these shapes; MLP seeds 0-4, LM head seeds 0-29): outputs, input and hidden-state gradients
# 1.00 (same rounding as upstream); parameter gradients 1.09-1.13 (MLP, 32 mini-sequences) and
# 1.18-1.36 (LM head, 18: each chunk's gradient is rounded to bf16 before the fp32 sum). Summing
# them over the mini-sequences in bf16 instead of fp32 gives 2.04-2.19 (MLP), 2.06-2.45 (LM head).
# A tolerance of 2e-2 of max|upstream| (before) could not tell the two apart.
BF16_FACTOR = 1.5


def rel_norm_error(actual, reference):
    actual, reference = actual.double(), reference.double()
    return ((actual - reference).norm() / reference.norm()).item()


def assert_as_accurate_as_upstream(ours, upstream, reference, names):
    """``ours`` and ``upstream``: the same bf16 computation, chunked and unsplit; ``reference``:
    it in fp64 from the same (bf16-rounded) inputs and weights."""
    for got, up, ref, name in zip(ours, upstream, reference, names, strict=True):
        err, err_up = rel_norm_error(got, ref), rel_norm_error(up, ref)
        assert err <= BF16_FACTOR * err_up, f"{name}: error {err:.2e} vs fp64, upstream bf16 {err_up:.2e}"


def as_fp64(module, rounded_to=None):
    """A float64 copy of ``module`` with the same weights (first rounded to ``rounded_to``)."""
    copied = copy.deepcopy(module)
    if rounded_to is not None:
        copied.to(rounded_to)
    return copied.double()


def llama_mlp(bias=False, dtype=torch.float32):
    cfg = LlamaConfig(hidden_size=D, intermediate_size=I, mlp_bias=bias, hidden_act="silu")
    return LlamaMLP(cfg).to(dtype)


def gemma2_mlp():
    cfg = Gemma2Config(hidden_size=D, intermediate_size=I, hidden_activation="gelu_pytorch_tanh")
    return Gemma2MLP(cfg)


def grads_of(out, grad_out, inputs):
    return torch.autograd.grad(out, inputs, grad_out)


def graph_nodes(tensor):
    """Every autograd node reachable from ``tensor.grad_fn``."""
    seen, stack = [], [tensor.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or any(node is s for s in seen):
            continue
        seen.append(node)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return seen


def uses_function(tensor, function):
    """Whether the custom autograd ``function`` produced a node of ``tensor``'s graph."""
    return any(type(node) is function._backward_cls for node in graph_nodes(tensor))


# --------------------------------------------------------------------------- config values


@pytest.mark.parametrize("value", [0, -1, 1.0, 4.0, True, False, "Auto", "x", "", [], {}, 2**0.5])
def test_validate_rejects(value):
    with pytest.raises(ValueError) as err:
        validate_mini_sequence_chunk(value)
    msg = str(err.value)
    assert "mini_sequence_chunk" in msg and repr(value) in msg and '"auto"' in msg and "None" in msg


@pytest.mark.parametrize("value", [None, "auto", 1, 4096])
def test_validate_accepts(value):
    assert validate_mini_sequence_chunk(value) is value


def test_chunk_size_policy():
    assert mlp_chunk_size("auto", 4096) == 4096
    assert mlp_chunk_size(100, 4096) == 100
    # Llama-3-8B: V=128256, d=4096 -> M = 32 mini-sequences, once chunks exceed the floor
    assert lm_head_chunk_size("auto", 4096, 128256, 65536) == 2048
    assert lm_head_chunk_size("auto", 4096, 128256, 65537) == 2049
    # shorter: chunks of AUTO_MIN_LM_HEAD_TOKENS (a chunk larger than N is one chunk)
    assert lm_head_chunk_size("auto", 4096, 128256, 8192) == AUTO_MIN_LM_HEAD_TOKENS == 1024
    assert lm_head_chunk_size("auto", 64, 100, 7) == 1024
    assert lm_head_chunk_size(33, 4096, 128256, 8192) == 33
    # longer: at most AUTO_MAX_LM_HEAD_LOGITS logits per chunk (8371 tokens of V=128256 from N > 32 * 8371)
    assert lm_head_chunk_size("auto", 4096, 128256, 32 * 8371) == 8371 == AUTO_MAX_LM_HEAD_LOGITS // 128256
    assert lm_head_chunk_size("auto", 4096, 128256, 32 * 8371 + 1) == 8371  # uncapped: 8372
    assert lm_head_chunk_size("auto", 4096, 128256, 1 << 20) == 8371  # uncapped: 32768
    assert lm_head_chunk_size("auto", 64, 2**22, 1 << 20) == 1024  # the floor wins over the cap
    assert lm_head_chunk_size(33, 4096, 128256, 1 << 20) == 33


def test_fields_module_does_not_import_torch():
    import subprocess
    import sys

    # The configuration classes validate through mst_core/fields.py: load it on its own with torch unimportable.
    path = __import__("transformers.mst_core.fields", fromlist=["x"]).__file__
    code = (
        "import sys, importlib.util; sys.modules['torch'] = None\n"
        f"spec = importlib.util.spec_from_file_location('fields', {path!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "assert m.validate_mini_sequence_chunk('auto') == 'auto'\n"
        "assert m.validate_streaming_backward_chunk(4) == 4\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------- MLP


def check_mlp(mlp, chunk, batch=2, seq=S, x_requires_grad=True, rtol=1e-5, dtype=torch.float32):
    x = torch.randn(batch, seq, D, dtype=dtype, requires_grad=x_requires_grad)
    params = [p for p in mlp.parameters() if p.requires_grad]
    inputs = ([x] if x_requires_grad else []) + params
    ref = mlp(x)
    grad_out = torch.randn_like(ref)
    ref_grads = grads_of(ref, grad_out, inputs)
    out = mini_sequence_mlp(mlp, x, chunk)
    # Split sequences go through our Function (which is what the comparison checks); a sequence
    # of one chunk takes upstream's path.
    assert uses_function(out, _MiniSequenceMLPFunction) == (chunk < seq)
    got = grads_of(out, grad_out, inputs)
    assert_rel_close(out, ref, rtol, "output")
    for g, r in zip(got, ref_grads):
        assert_rel_close(g, r, rtol, "grad")
    return out


@pytest.mark.parametrize("chunk", CHUNKS)
def test_mlp_llama_matches_unsplit(chunk):
    torch.manual_seed(chunk)
    check_mlp(llama_mlp(), chunk)


@pytest.mark.parametrize("chunk", [1, 7, S - 1])
def test_mlp_gemma2_gelu_tanh(chunk):
    torch.manual_seed(100 + chunk)
    check_mlp(gemma2_mlp(), chunk)


def test_mlp_with_bias_and_batch3():
    torch.manual_seed(1)
    check_mlp(llama_mlp(bias=True), 6, batch=3)


def test_mlp_only_params_need_grad():
    torch.manual_seed(2)
    check_mlp(llama_mlp(), 7, x_requires_grad=False)


def test_mlp_only_input_needs_grad():
    torch.manual_seed(3)
    mlp = llama_mlp().requires_grad_(False)
    check_mlp(mlp, 7)


def test_mlp_short_sequence_takes_unsplit_path():
    torch.manual_seed(4)
    mlp = llama_mlp()
    x = torch.randn(2, 16, D, requires_grad=True)
    out = mini_sequence_mlp(mlp, x, 16)
    ref = mlp(x)
    assert torch.equal(out, ref)
    # The very graph upstream builds: no Function of ours, no chunking (slices, cat, checkpoint).
    assert not uses_function(out, _MiniSequenceMLPFunction)
    assert [type(n).__name__ for n in graph_nodes(out)] == [type(n).__name__ for n in graph_nodes(ref)]
    # One token more: the Function runs (the check above can tell the two paths apart).
    longer = torch.randn(2, 17, D, requires_grad=True)
    assert uses_function(mini_sequence_mlp(mlp, longer, 16), _MiniSequenceMLPFunction)


def test_mlp_no_grad_path():
    torch.manual_seed(5)
    mlp = llama_mlp()
    x = torch.randn(2, S, D)
    with torch.no_grad():
        out = mini_sequence_mlp(mlp, x, 7)
        assert_rel_close(out, mlp(x), 1e-6, "no_grad")
    assert out.grad_fn is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sums_start_from_a_tensor_of_their_own(dtype):
    """A gradient autograd expands from a reduction (the parameter's `sum()`: one element seen at every position)
    starts a sum that the next chunk's gradient is added into in place: summed as computed, the result is the
    sum of the chunks' gradients, not an error (in-place add into an expanded tensor) or a corrupted operand."""
    weight = torch.randn(4, 3, dtype=dtype, requires_grad=True)
    x = torch.randn(3, dtype=dtype)
    acc = [None]
    with core_grads.summed_as_computed(acc, [weight]):
        torch.autograd.grad(2 * weight.sum(), [weight])  # the first chunk's gradient: 2, expanded
        torch.autograd.grad((x @ weight.t()).sum(), [weight])
    expected = x.double().expand(4, 3) + 2
    torch.testing.assert_close(acc[0].double(), expected, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=0)


def test_mlp_param_accumulate_hooks_fire_once():
    # Gradients come out of the Function once per parameter: .grad is accumulated once, so
    # post-accumulate hooks (DDP / FSDP2 / DeepSpeed style) fire once per backward.
    torch.manual_seed(6)
    mlp = llama_mlp()
    calls = {}
    for name, p in mlp.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=name: calls.__setitem__(n, calls.get(n, 0) + 1))
    x = torch.randn(1, S, D, requires_grad=True)
    mini_sequence_mlp(mlp, x, 7).sum().backward()
    assert calls == {n: 1 for n, _ in mlp.named_parameters()}


def fp32_out_addmm_stand_in(monkeypatch):
    """``torch.addmm(..., out_dtype=torch.float32, out=acc)``, a kernel CUDA has and this CPU has not, stood in for
    by its definition (fp32 products, fp32 sums; docs/cuda/README.md has the real one measured on an H100).
    Returns the list of (first matrix's shape, dtype) of each call."""
    real_addmm = torch.addmm
    calls = []

    def addmm(input, mat1, mat2, *, out_dtype=None, out=None, **kwargs):
        if out_dtype is None:
            return real_addmm(input, mat1, mat2, out=out, **kwargs)
        assert out is input and out_dtype == out.dtype == torch.float32 and not kwargs
        calls.append((tuple(mat1.shape), mat1.dtype))
        return out.add_(mat1.float() @ mat2.float())

    monkeypatch.setattr(torch, "addmm", addmm)
    monkeypatch.setattr(core_grads, "_NO_FP32_OUT_GEMM", set())
    return calls


def bf16_mlp_against_upstream(mlp16, seq, chunk, seed):
    """Output and gradients of ``mlp16`` by mini-sequences, checked as accurate as upstream bf16 against fp64."""
    torch.manual_seed(seed)
    mlp64 = as_fp64(mlp16)
    x16 = torch.randn(2, seq, D).bfloat16().requires_grad_()
    g16 = torch.randn(2, seq, D).bfloat16()
    x64 = x16.detach().double().requires_grad_()
    ref = mlp64(x64)
    ref_grads = grads_of(ref, g16.double(), [x64, *mlp64.parameters()])
    up = mlp16(x16)
    up_grads = grads_of(up, g16, [x16, *mlp16.parameters()])
    out = mini_sequence_mlp(mlp16, x16, chunk)
    assert uses_function(out, _MiniSequenceMLPFunction)
    got = grads_of(out, g16, [x16, *mlp16.parameters()])
    assert out.dtype == torch.bfloat16
    assert all(g.dtype == torch.bfloat16 for g in got)
    names = ["output", "x grad", *(f"{n} grad" for n, _ in mlp16.named_parameters())]
    assert_as_accurate_as_upstream([out, *got], [up, *up_grads], [ref, *ref_grads], names)


def test_mlp_bf16_as_accurate_as_upstream():
    # 32 mini-sequences, so that summing the weight gradients in bf16 would show (see BF16_FACTOR).
    torch.manual_seed(7)
    bf16_mlp_against_upstream(llama_mlp(dtype=torch.bfloat16), 256, 8, seed=8)


def test_mlp_bf16_linear_weights_one_fp32_out_gemm_per_chunk(monkeypatch):
    # With a GEMM that writes fp32 (CUDA), each chunk's gradient of each linear weight is one such GEMM into the
    # fp32 sum; the biases' and the input's gradients still come from autograd.
    calls = fp32_out_addmm_stand_in(monkeypatch)
    torch.manual_seed(10)
    mlp16 = llama_mlp(bias=True, dtype=torch.bfloat16)
    seq, chunk = 100, 8
    bf16_mlp_against_upstream(mlp16, seq, chunk, seed=11)
    sizes = [min(chunk, seq - start) for start in range(0, seq, chunk)]
    # per chunk of n tokens (batch 2): gate_proj and up_proj [I, D], down_proj [D, I]; grad_out^T is [out, 2n]
    expected = [((out, 2 * n), torch.bfloat16) for n in sizes for out in (I, I, D)]
    assert sorted(calls) == sorted(expected)


@pytest.mark.parametrize("batch", [1, 2])
def test_mlp_linear_takeover_folds_rows_like_matmul(monkeypatch, batch):
    # A chunk is a strided view of the sequence; with its weight detached, matmul would not fold its rows and
    # would run bmm (on an H100: 47 ms a step at 16K tokens). The takeover folds them: mm only.
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    calls = fp32_out_addmm_stand_in(monkeypatch)
    mlp16 = llama_mlp(dtype=torch.bfloat16)
    x = torch.randn(batch, S, D).bfloat16().requires_grad_()
    out = mini_sequence_mlp(mlp16, x, 8)
    with CountOps() as ops:
        out.sum().backward()
    assert len(calls) == 3 * 5 and "bmm" not in ops.names and "mm" in ops.names


class LinearAndMatmulMLP(nn.Module):
    """A weight used by a linear layer and by a plain matmul in the same forward."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(D, I, bias=False)
        self.down = nn.Linear(I, D, bias=False)

    def forward(self, x):
        h = F.silu(self.up(x))
        return self.down(h) + 0.5 * (h @ self.down.weight.T)


@pytest.mark.parametrize("fp32_out_gemm", [True, False])
def test_mlp_bf16_weight_used_by_linear_and_matmul(monkeypatch, fp32_out_gemm):
    # The linear layer's part of `down.weight`'s gradient is summed by the GEMM, the matmul's by autograd: both.
    calls = fp32_out_addmm_stand_in(monkeypatch) if fp32_out_gemm else None
    torch.manual_seed(12)
    bf16_mlp_against_upstream(LinearAndMatmulMLP().bfloat16(), 64, 8, seed=13)
    assert calls is None or len(calls) == 2 * 8


def test_mlp_autocast_recompute_uses_forward_autocast_state():
    torch.manual_seed(8)
    mlp = llama_mlp()
    x = torch.randn(2, S, D, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = mlp(x)
        out = mini_sequence_mlp(mlp, x, 7)
    assert out.dtype == ref.dtype == torch.bfloat16
    g = torch.randn_like(ref)
    # backward deliberately outside autocast: the recomputation must re-enter it
    ref_grads = grads_of(ref, g, [x, *mlp.parameters()])
    seen = []
    mlp.gate_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    got = grads_of(out, g, [x, *mlp.parameters()])
    assert seen and set(seen) == {torch.bfloat16}  # the recomputation ran under autocast
    # Per-token x gradient does not depend on chunking: same bf16 ops -> same numbers.
    assert_rel_close(got[0], ref_grads[0], 1e-6, "autocast x grad")
    # fp64 reference from what autocast computes with: x and the weights rounded to bf16.
    mlp64 = as_fp64(mlp, rounded_to=torch.bfloat16)
    x64 = x.detach().bfloat16().double().requires_grad_()
    ref64 = mlp64(x64)
    ref64_grads = grads_of(ref64, g.double(), [x64, *mlp64.parameters()])
    names = ["output", "x grad", *(f"{n} grad" for n, _ in mlp.named_parameters())]
    assert_as_accurate_as_upstream([out, *got], [ref, *ref_grads], [ref64, *ref64_grads], names)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_mlp_inside_gradient_checkpointing(use_reentrant):
    torch.manual_seed(9)
    mlp = llama_mlp()
    norm = nn.LayerNorm(D)
    x = torch.randn(2, S, D, requires_grad=True)
    params = [x, *mlp.parameters(), *norm.parameters()]

    def block(h, chunk):
        h = norm(h)
        return h + (mini_sequence_mlp(mlp, h, chunk) if chunk else mlp(h))

    ref = block(x, None)
    g = torch.randn_like(ref)
    ref_grads = grads_of(ref, g, params)
    out = torch.utils.checkpoint.checkpoint(block, x, 7, use_reentrant=use_reentrant)
    if use_reentrant:
        torch.autograd.backward(out, g)  # reentrant checkpoint does not support autograd.grad
        got = [p.grad for p in params]
    else:
        got = grads_of(out, g, params)
    assert_rel_close(out, ref, 1e-5, "output")
    for a, b in zip(got, ref_grads):
        assert_rel_close(a, b, 1e-5, "grad")


def _lora_mlp(dropout):
    import peft  # pinned in requirements-test.txt: a missing install fails, it does not skip
    mlp = llama_mlp()
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=["gate_proj", "up_proj", "down_proj"])
    mlp = peft.inject_adapter_in_model(cfg, mlp)
    for name, p in mlp.named_parameters():
        if "lora_B" in name:  # LoRA B starts at zero; make the adapter contribute
            nn.init.normal_(p, std=0.1)
    return mlp


def test_mlp_peft_lora():
    torch.manual_seed(10)
    mlp = _lora_mlp(0.0)
    trainable = [n for n, p in mlp.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    check_mlp(mlp, 7)


def test_mlp_peft_lora_dropout_recompute_draws_same_masks():
    # With dropout, the reference is the same chunked computation under plain autograd with the
    # same seed: the recomputation in backward must reproduce the forward's dropout masks.
    torch.manual_seed(11)
    mlp = _lora_mlp(0.3).train()
    params = [p for p in mlp.parameters() if p.requires_grad]
    x = torch.randn(2, S, D, requires_grad=True)
    g = torch.randn(2, S, D)
    torch.manual_seed(123)
    ref = torch.cat([mlp(x[:, s : s + 7]) for s in range(0, S, 7)], dim=1)
    ref_grads = grads_of(ref, g, [x, *params])
    torch.manual_seed(123)
    out = mini_sequence_mlp(mlp, x, 7)
    state_after_forward = torch.get_rng_state()
    got = grads_of(out, g, [x, *params])
    assert torch.equal(torch.get_rng_state(), state_after_forward)  # backward leaves RNG alone
    for a, b in zip([out, *got], [ref, *ref_grads]):
        assert_rel_close(a, b, 1e-5, "lora dropout")


# --------------------------------------------------------------------------- LM head + loss


def reference_loss(hidden, head, labels, softcap=None, **kw):
    logits = head(hidden)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return ForCausalLMLoss(logits, labels, V, **kw)


def make_labels(batch, seq, ignored_row=True):
    labels = torch.randint(0, V, (batch, seq))
    labels[0, :5] = -100
    labels[0, -3:] = -100  # right padding
    if ignored_row and batch > 1:
        labels[1] = -100
    return labels


@pytest.fixture
def loss_backends(monkeypatch):
    """Counts the calls of each backend of ``mini_sequence_causal_lm_loss``: torch's
    ``F.linear_cross_entropy`` ("torch_lce"), our Function ("own"), its vocabulary-sliced variant for
    half-precision heads with more vocabulary rows than tokens ("sliced"), the per-chunk checkpointed path taken
    under wrappers ("wrapped")."""
    calls = {"torch_lce": 0, "own": 0, "sliced": 0, "wrapped": 0}

    def spy(name, real):
        def counted(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)

        return counted

    if hasattr(F, "linear_cross_entropy"):  # loss.py calls it as F.linear_cross_entropy
        monkeypatch.setattr(F, "linear_cross_entropy", spy("torch_lce", F.linear_cross_entropy))
    function = ms_loss._MiniSequenceLMLossFunction
    monkeypatch.setattr(function, "apply", staticmethod(spy("own", function.apply)))
    sliced = ms_loss._VocabSlicedLMLossFunction
    monkeypatch.setattr(sliced, "apply", staticmethod(spy("sliced", sliced.apply)))
    monkeypatch.setattr(ms_loss, "checkpointed_chunks", spy("wrapped", ms_loss.checkpointed_chunks))
    return calls


def assert_only_backend(calls, name):
    assert calls[name] > 0 and all(n == 0 for b, n in calls.items() if b != name), (name, calls)


@pytest.fixture(params=["own", "torch_lce"])
def loss_path(request, monkeypatch, loss_backends):
    """``own``: the mini-sequence Function; ``torch_lce``: torch's linear_cross_entropy where it
    applies. After the test: the chosen backend ran, and no other one."""
    if request.param == "own":
        monkeypatch.setattr(ms_loss, "_can_use_linear_cross_entropy", lambda *a: False)
    yield request.param
    assert_only_backend(loss_backends, request.param)


def check_loss(head, chunk, batch=3, seq=S, softcap=None, rtol=1e-5, inputs_extra=(), make_hidden=None, **kw):
    labels = kw.pop("labels", None)
    if labels is None:
        labels = make_labels(batch, seq)
    hidden = make_hidden() if make_hidden else torch.randn(batch, seq, D, requires_grad=True)
    leaves = [hidden] if hidden.is_leaf else []
    inputs = leaves + [p for p in head.parameters() if p.requires_grad] + list(inputs_extra)
    ref = reference_loss(hidden, head, labels, softcap=softcap, **kw)
    ref_grads = torch.autograd.grad(ref, inputs)
    if make_hidden:  # a fresh graph for the second computation
        hidden = make_hidden()
    got_loss = mini_sequence_causal_lm_loss(
        hidden, head, labels, chunk_size=chunk, vocab_size=V, final_logit_softcapping=softcap, **kw
    )
    got_grads = torch.autograd.grad(got_loss, inputs)
    assert got_loss.shape == ref.shape == ()
    assert_rel_close(got_loss, ref, rtol, "loss")
    for a, b in zip(got_grads, ref_grads):
        assert_rel_close(a, b, rtol, "grad")


@pytest.mark.parametrize("chunk", CHUNKS + [3 * S - 1, 3 * S + 5])
def test_loss_matches_upstream(chunk, loss_path):
    torch.manual_seed(20 + chunk)
    check_loss(nn.Linear(D, V, bias=False), chunk)


@pytest.mark.parametrize(
    "num_items", [7, torch.tensor(13), torch.tensor(13.0)], ids=["int", "tensor_int", "tensor_float"]
)
def test_loss_num_items_in_batch(num_items, loss_path):
    torch.manual_seed(21)
    check_loss(nn.Linear(D, V, bias=False), 7, num_items_in_batch=num_items)


def test_loss_shift_labels(loss_path):
    torch.manual_seed(22)
    shift = make_labels(3, S)
    check_loss(nn.Linear(D, V, bias=False), 7, labels=make_labels(3, S), shift_labels=shift)


def test_loss_with_bias_and_softcap(loss_backends):
    torch.manual_seed(23)
    check_loss(nn.Linear(D, V, bias=True), 7)
    check_loss(nn.Linear(D, V, bias=False), 7, softcap=2.0)
    check_loss(nn.Linear(D, V, bias=True), 5, softcap=2.0, num_items_in_batch=9)
    assert_only_backend(loss_backends, "own")  # torch's op has neither bias nor soft-capping


def test_loss_all_ignored_is_nan_like_upstream(loss_path):
    torch.manual_seed(24)
    head = nn.Linear(D, V, bias=False)
    hidden = torch.randn(2, S, D, requires_grad=True)
    labels = torch.full((2, S), -100)
    ref = reference_loss(hidden, head, labels)
    ref_grads = torch.autograd.grad(ref, [hidden, head.weight])
    got = mini_sequence_causal_lm_loss(hidden, head, labels, chunk_size=7, vocab_size=V)
    got_grads = torch.autograd.grad(got, [hidden, head.weight])
    assert torch.isnan(ref) and torch.isnan(got)
    for a, b in zip(got_grads, ref_grads):
        assert torch.equal(a, b)  # upstream: zero gradients
    # with num_items_in_batch upstream gives 0 (sum of nothing / n)
    ref = reference_loss(hidden, head, labels, num_items_in_batch=5)
    got = mini_sequence_causal_lm_loss(hidden, head, labels, chunk_size=7, vocab_size=V, num_items_in_batch=5)
    assert ref.item() == got.item() == 0.0


def test_loss_tied_embeddings(loss_path):
    # lm_head.weight is embed_tokens.weight: both uses must add up in the one gradient.
    torch.manual_seed(25)
    embed = nn.Embedding(V, D)
    head = nn.Linear(D, V, bias=False)
    head.weight = embed.weight
    ids = torch.randint(0, V, (3, S))
    proj = nn.Linear(D, D)
    check_loss(head, 7, make_hidden=lambda: torch.tanh(proj(embed(ids))), inputs_extra=list(proj.parameters()))


def test_loss_no_grad_and_frozen(loss_path):
    torch.manual_seed(26)
    head = nn.Linear(D, V, bias=False)
    hidden = torch.randn(3, S, D)
    labels = make_labels(3, S)
    with torch.no_grad():
        ref = reference_loss(hidden, head, labels)
        got = mini_sequence_causal_lm_loss(hidden, head, labels, chunk_size=7, vocab_size=V)
    assert_rel_close(got, ref, 1e-5, "no_grad")
    head.requires_grad_(False)
    check_loss(head, 7)  # gradient only for the hidden states


def fp64_loss_grads(hidden, head, labels):
    """Loss and gradients (hidden, head weight) in fp64 from bf16-rounded hidden states and weights."""
    head64 = as_fp64(head, rounded_to=torch.bfloat16)
    hidden64 = hidden.detach().bfloat16().double().requires_grad_()
    loss = reference_loss(hidden64, head64, labels)
    return loss, torch.autograd.grad(loss, [hidden64, head64.weight])


def test_loss_bf16_as_accurate_as_upstream(loss_backends):
    # 18 LM-head mini-sequences: summing the head's gradient over them in bf16 would show.
    torch.manual_seed(27)
    head = nn.Linear(D, V, bias=False).bfloat16()
    hidden = torch.randn(3, S, D, dtype=torch.bfloat16, requires_grad=True)
    labels = make_labels(3, S)
    up = reference_loss(hidden, head, labels)
    up_grads = torch.autograd.grad(up, [hidden, head.weight])
    got = mini_sequence_causal_lm_loss(hidden, head, labels, chunk_size=7, vocab_size=V)
    got_grads = torch.autograd.grad(got, [hidden, head.weight])
    assert_only_backend(loss_backends, "own")
    assert got.dtype == torch.float32
    assert_rel_close(got, up, 1e-5, "bf16 loss")  # fp32 sum of the same bf16 logits
    assert all(a.dtype == torch.bfloat16 for a in got_grads)
    _, ref_grads = fp64_loss_grads(hidden, head, labels)
    assert_as_accurate_as_upstream(got_grads, up_grads, ref_grads, ["hidden grad", "weight grad"])


def test_loss_bf16_weight_grad_one_fp32_out_gemm_per_chunk(loss_backends, monkeypatch):
    # Where the backend has `addmm(..., out_dtype=torch.float32)` (CUDA; not this CPU), a bf16 chunk's weight
    # gradient is one GEMM into the fp32 accumulator, never a bf16 product.
    calls = fp32_out_addmm_stand_in(monkeypatch)
    torch.manual_seed(28)
    head = nn.Linear(D, V, bias=False).bfloat16()
    hidden = torch.randn(3, S, D, dtype=torch.bfloat16, requires_grad=True)
    labels = make_labels(3, S)
    up_grads = torch.autograd.grad(reference_loss(hidden, head, labels), [hidden, head.weight])
    got = mini_sequence_causal_lm_loss(hidden, head, labels, chunk_size=7, vocab_size=V)
    got_grads = torch.autograd.grad(got, [hidden, head.weight])
    assert_only_backend(loss_backends, "own")
    chunks = -(-3 * S // 7)
    assert calls == [((V, 7), torch.bfloat16)] * (chunks - 1) + [((V, 3 * S - 7 * (chunks - 1)), torch.bfloat16)]
    _, ref_grads = fp64_loss_grads(hidden, head, labels)
    assert_as_accurate_as_upstream(got_grads, up_grads, ref_grads, ["hidden grad", "weight grad"])


# A vocabulary larger than the token count: half-precision plain heads take `_VocabSlicedLMLossFunction`.
V_BIG = 1000


def sliced_case(seed, dtype=torch.bfloat16, bias=False, batch=2, seq=150):
    torch.manual_seed(seed)
    head = nn.Linear(D, V_BIG, bias=bias).to(dtype)
    hidden = torch.randn(batch, seq, D, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, V_BIG, (batch, seq))
    labels[0, :9] = -100
    labels[-1, -4:] = -100  # right padding
    return head, hidden, labels


def big_vocab_loss(hidden, head, labels, softcap=None, **kw):
    logits = head(hidden)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return ForCausalLMLoss(logits, labels, V_BIG, **kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("softcap", [None, 2.0])  # small: the cap bends the logits
@pytest.mark.parametrize("chunk", [7, 37, 300])
def test_loss_vocab_sliced_as_accurate_as_upstream(loss_backends, dtype, softcap, chunk):
    # Fresh inputs per case; uneven token chunks (37, 7) and vocabulary slices (1000 rows in 8 slices of 125).
    head, hidden, labels = sliced_case(40 + chunk, dtype)
    up = big_vocab_loss(hidden, head, labels, softcap)
    up_grads = torch.autograd.grad(up, [hidden, head.weight])
    got = mini_sequence_causal_lm_loss(
        hidden, head, labels, chunk_size=chunk, vocab_size=V_BIG, final_logit_softcapping=softcap
    )
    got_grads = torch.autograd.grad(got, [hidden, head.weight])
    assert_only_backend(loss_backends, "sliced")
    assert got.dtype == torch.float32
    assert_rel_close(got, up, 1e-5, "loss")  # fp32 sums of the same half-precision logits
    assert all(g.dtype == dtype for g in got_grads)
    head64 = as_fp64(head)
    hidden64 = hidden.detach().double().requires_grad_()
    ref = big_vocab_loss(hidden64, head64, labels, softcap)
    ref_grads = torch.autograd.grad(ref, [hidden64, head64.weight])
    assert_as_accurate_as_upstream(got_grads, up_grads, ref_grads, ["hidden grad", "weight grad"])


def test_loss_vocab_sliced_fp32_out_gemms(loss_backends, monkeypatch):
    # Where the backend has an fp32-output GEMM (CUDA), the hidden states' gradient of each vocabulary slice is one
    # such GEMM of the half-precision operands, [N, slice] x [slice, d], over all tokens at once; the slice's weight
    # gradient is one half-precision GEMM over all tokens (its fp32 sum is inside the GEMM, as upstream's).
    calls = fp32_out_addmm_stand_in(monkeypatch)
    head, hidden, labels = sliced_case(47)
    up_grads = torch.autograd.grad(big_vocab_loss(hidden, head, labels), [hidden, head.weight])
    got = mini_sequence_causal_lm_loss(hidden, head, labels, chunk_size=100, vocab_size=V_BIG)
    got_grads = torch.autograd.grad(got, [hidden, head.weight])
    assert_only_backend(loss_backends, "sliced")
    tokens = hidden.shape[0] * hidden.shape[1]
    rows = ms_loss._vocab_slice_rows(V_BIG, tokens, 100, D)
    assert rows == 128  # 1000 * min(chunk 100, d/2 = 16) / 300 tokens = 54, rounded up to a multiple of 128
    assert calls == [((tokens, rows), torch.bfloat16)] * 7 + [((tokens, V_BIG - 7 * rows), torch.bfloat16)]
    head64 = as_fp64(head)
    hidden64 = hidden.detach().double().requires_grad_()
    ref_grads = torch.autograd.grad(big_vocab_loss(hidden64, head64, labels), [hidden64, head64.weight])
    assert_as_accurate_as_upstream(got_grads, up_grads, ref_grads, ["hidden grad", "weight grad"])


class _CountTorchCalls(TorchDispatchMode):
    """Counts the aten calls that are not views (each a kernel launch on a GPU)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += not func.is_view
        return func(*args, **(kwargs or {}))


def _blocks(length, row_blocks):
    rows = -(-length // row_blocks)
    return -(-length // rows)


@pytest.mark.parametrize("path", ["own", "sliced"])
def test_loss_row_blocks_cost_few_torch_calls(path, loss_backends, monkeypatch):
    # On a GPU the loss's row blocks are small and their kernel launches set its time: a block may only run its
    # [rows, V] passes, everything per token is done once per chunk or slice. Until mst.27 a block ran 17 calls in
    # the forward and 10 in the sliced backward (LM head alone on an H200, d=4096, 8K tokens, V=32000: 52.8 ms, now
    # 24.2). Counted: the extra calls of a run with twice the row blocks.
    chunk = 37
    if path == "own":
        monkeypatch.setattr(ms_loss, "_vocab_sliced_backward_pays", lambda *args: False)
    head, hidden, labels = sliced_case(49)
    tokens = hidden.shape[0] * hidden.shape[1]
    chunks = [min(chunk, tokens - start) for start in range(0, tokens, chunk)]
    slices = -(-V_BIG // ms_loss._vocab_slice_rows(V_BIG, tokens, chunk, D))

    def calls_and_blocks(row_blocks):
        monkeypatch.setattr(ms_loss, "_ROW_BLOCKS_PER_CHUNK", row_blocks)
        with _CountTorchCalls() as counter:
            loss = mini_sequence_causal_lm_loss(hidden, head, labels, chunk_size=chunk, vocab_size=V_BIG)
            torch.autograd.grad(loss, [hidden, head.weight])
        if path == "own":  # one pass per block: the loss and its gradient
            return counter.calls, {"pass": sum(_blocks(c, row_blocks) for c in chunks)}
        return counter.calls, {"forward": sum(_blocks(c, 2 * row_blocks) for c in chunks),
                               "backward": slices * _blocks(tokens, row_blocks)}

    calls_few, blocks_few = calls_and_blocks(4)
    calls_many, blocks_many = calls_and_blocks(8)
    assert loss_backends[path] == 2
    extra = {kind: blocks_many[kind] - blocks_few[kind] for kind in blocks_few}
    assert all(n > 0 for n in extra.values()), extra
    # own: log_softmax (after its fp32 copy), gather, exp_, mul_, scatter_add_, copy_ into the logits' dtype;
    # sliced: the forward's fp32 copy, log_softmax and gather; the backward's sub, exp_, scatter_add_ and mul
    budget = {"pass": 7, "forward": 3, "backward": 4}
    assert calls_many - calls_few <= sum(budget[kind] * n for kind, n in extra.items()), (calls_many - calls_few, extra)


def test_loss_vocab_sliced_divisors_and_incoming_gradient(loss_backends):
    # num_items_in_batch (the Trainer's accumulation divisor), a loss scaled before backward, a frozen bias, a head
    # tied to an embedding, and every label ignored (upstream: NaN loss, zero gradients; 0 with num_items_in_batch).
    head, hidden, labels = sliced_case(48, bias=True)
    head.bias.requires_grad_(False)
    for kw in ({}, {"num_items_in_batch": torch.tensor(211)}):
        up = big_vocab_loss(hidden, head, labels, **kw) * 3.0
        got = mini_sequence_causal_lm_loss(hidden, head, labels, chunk_size=64, vocab_size=V_BIG, **kw) * 3.0
        up_grads = torch.autograd.grad(up, [hidden, head.weight])
        got_grads = torch.autograd.grad(got, [hidden, head.weight])
        assert_rel_close(got, up, 1e-5, "loss")
        for a, b in zip(got_grads, up_grads):
            assert_rel_close(a, b, 2e-2, "grad")  # bf16 results of one computation, summed in another order
    ignored = torch.full_like(labels, -100)
    got = mini_sequence_causal_lm_loss(hidden, head, ignored, chunk_size=64, vocab_size=V_BIG)
    got_grads = torch.autograd.grad(got, [hidden, head.weight])
    assert torch.isnan(got) and all(torch.equal(g, torch.zeros_like(g)) for g in got_grads)
    got = mini_sequence_causal_lm_loss(hidden, head, ignored, chunk_size=64, vocab_size=V_BIG, num_items_in_batch=5)
    assert got.item() == 0.0
    embed = nn.Embedding(V_BIG, D).bfloat16()
    tied = nn.Linear(D, V_BIG, bias=False).bfloat16()
    tied.weight = embed.weight
    ids = torch.randint(0, V_BIG, (2, 150))
    grads = []
    for loss_fn in (big_vocab_loss, None):
        hidden_states = torch.tanh(embed(ids))
        if loss_fn is None:
            loss = mini_sequence_causal_lm_loss(hidden_states, tied, labels, chunk_size=64, vocab_size=V_BIG)
        else:
            loss = loss_fn(hidden_states, tied, labels)
        grads.append(torch.autograd.grad(loss, [embed.weight])[0])
    assert_rel_close(grads[1], grads[0], 2e-2, "tied weight grad")
    assert loss_backends["sliced"] == 5 and loss_backends["own"] == 0


def test_loss_vocab_sliced_only_where_it_holds_less(loss_backends):
    pays = ms_loss._vocab_sliced_backward_pays
    head = nn.Linear(D, V_BIG, bias=False).bfloat16()
    short, long = torch.zeros(V_BIG - 1, D).bfloat16(), torch.zeros(V_BIG, D).bfloat16()
    assert pays(head, short, [head.weight], V_BIG)
    assert not pays(head, long, [head.weight], V_BIG)  # its [N, d] fp32 sum is no smaller than the [V, d] one
    assert not pays(head, short, [], V_BIG)  # frozen head: no [V, d] sum to avoid
    with_bias = nn.Linear(D, V_BIG, bias=True).bfloat16()
    assert not pays(with_bias, short, [with_bias.weight, with_bias.bias], V_BIG)
    fp32 = nn.Linear(D, V_BIG, bias=False)
    assert not pays(fp32, short.float(), [fp32.weight], V_BIG)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not pays(head, short, [head.weight], V_BIG)
    # A slice's [N, rows] logits: as many elements as a forward chunk's [C, V] and at most half the [V, d] weight's,
    # rows a multiple of 128, at most V.
    assert ms_loss._vocab_slice_rows(32000, 8192, 1024, 4096) == 4096
    assert ms_loss._vocab_slice_rows(151936, 8192, 1024, 4096) == 19072  # 18992 rounded up
    assert ms_loss._vocab_slice_rows(262144, 32768, 1024, 2048) == 8192
    assert ms_loss._vocab_slice_rows(128256, 1000, 1024, 4096) == 128256  # one chunk: one slice
    assert ms_loss._vocab_slice_rows(128256, 8192, 1024, 256) == 2048  # V * 128 / 8192 = 2004, rounded up
    # A token count at or above the vocabulary keeps the accumulating Function.
    head, hidden, labels = sliced_case(49, seq=V_BIG // 2)
    loss = mini_sequence_causal_lm_loss(hidden, head, labels, chunk_size=128, vocab_size=V_BIG)
    torch.autograd.grad(loss, [hidden, head.weight])
    assert_only_backend(loss_backends, "own")


def test_loss_vocab_sliced_peak_below_accumulating_function(monkeypatch):
    # The same loss and gradients with less held: no fp32 [V, d] sum (d=256, V=32000, 2048 tokens: 126.0 vs 78.2
    # MiB measured; this shape keeps V > N and d small enough for a fast test).
    torch.manual_seed(50)
    n_tokens, d, vocab, chunk = 512, 256, 8000, 256
    head = nn.Linear(d, vocab, bias=False).bfloat16()
    hidden = torch.randn(1, n_tokens, d).bfloat16()
    labels = torch.randint(0, vocab, (1, n_tokens))

    def run(sliced):
        if not sliced:
            monkeypatch.setattr(ms_loss, "_vocab_sliced_backward_pays", lambda *a: False)
        h = hidden.clone().requires_grad_()
        with LiveTensorTracker(keep_largest=10_000) as tracker:
            loss = mini_sequence_causal_lm_loss(h, head, labels, chunk_size=chunk, vocab_size=vocab)
            grads = torch.autograd.grad(loss, [h, head.weight])
        return tracker, loss, grads

    sliced, loss, grads = run(True)
    whole, loss_whole, grads_whole = run(False)
    # [V, d] tensors: the returned gradient only, against an fp32 sum and the gradient rounded from it.
    assert len([r for r in sliced.largest_shapes if r[1] == (vocab, d)]) == 1, sliced.largest_shapes[:5]
    assert len([r for r in whole.largest_shapes if r[1] == (vocab, d)]) == 2, whole.largest_shapes[:5]
    assert sliced.peak_bytes < 0.8 * whole.peak_bytes, (sliced.peak_bytes / 2**20, whole.peak_bytes / 2**20)
    assert_rel_close(loss, loss_whole, 1e-6, "loss")
    for a, b in zip(grads, grads_whole):
        assert_rel_close(a, b, 2e-2, "grad")


def test_loss_vocab_sliced_peak_is_one_chunk(loss_backends):
    # The sliced path holds no more than one forward chunk's bf16 [C, V] logits and a quarter of them in fp32 at any
    # time: its forward's log_softmax holds two fp32 row blocks at once (twice as many blocks), a block is freed
    # before the next, and a backward slice is no larger (at most half the [V, d] weight's elements).
    torch.manual_seed(51)
    n_tokens, d, vocab, chunk = 512, 64, 8000, 128
    head = nn.Linear(d, vocab, bias=False).bfloat16()
    hidden = torch.randn(1, n_tokens, d).bfloat16().requires_grad_()
    labels = torch.randint(0, vocab, (1, n_tokens))
    with LiveTensorTracker() as tracker:
        loss = mini_sequence_causal_lm_loss(hidden, head, labels, chunk_size=chunk, vocab_size=vocab)
        torch.autograd.grad(loss, [hidden, head.weight])
    assert_only_backend(loss_backends, "sliced")
    chunk_logits = chunk * vocab * 2
    assert tracker.peak_bytes <= 1.25 * chunk_logits + 64 * 1024, (tracker.peak_bytes, chunk_logits)


def test_loss_head_saving_its_output(loss_backends):
    # The head's last op saves its own output for backward (exp): the logits gradient then goes
    # into a buffer of its own instead of overwriting the logits.
    torch.manual_seed(35)

    class ExpHead(nn.Linear):
        def forward(self, x):
            return torch.exp(super().forward(x) / 4)

    check_loss(ExpHead(D, V, bias=False), 7)
    assert_only_backend(loss_backends, "own")


def test_loss_weight_grad_only(loss_backends):
    # Frozen hidden states: only the head's weight gradient is taken (no autograd.grad call).
    torch.manual_seed(36)
    head = nn.Linear(D, V, bias=False).bfloat16()
    hidden = torch.randn(3, S, D, dtype=torch.bfloat16)
    labels = make_labels(3, S)
    (up,) = torch.autograd.grad(reference_loss(hidden, head, labels), [head.weight])
    got = mini_sequence_causal_lm_loss(hidden, head, labels, chunk_size=7, vocab_size=V)
    (got_grad,) = torch.autograd.grad(got, [head.weight])
    assert_only_backend(loss_backends, "own")
    _, (_, ref) = fp64_loss_grads(hidden, head, labels)
    assert_as_accurate_as_upstream([got_grad], [up], [ref], ["weight grad"])


def test_loss_lora_head(loss_backends):
    import peft  # pinned in requirements-test.txt: a missing install fails, it does not skip
    torch.manual_seed(28)
    model = nn.Module()
    model.lm_head = nn.Linear(D, V, bias=False)
    model = peft.inject_adapter_in_model(peft.LoraConfig(r=4, target_modules=["lm_head"]), model)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p, std=0.1)
    check_loss(model.lm_head, 7)
    assert_only_backend(loss_backends, "own")  # the LoRA module is called, not its base weight


def test_loss_autocast(loss_backends):
    torch.manual_seed(29)
    head = nn.Linear(D, V, bias=False)
    hidden = torch.randn(3, S, D, requires_grad=True)
    labels = make_labels(3, S)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = reference_loss(hidden, head, labels)
        got = mini_sequence_causal_lm_loss(hidden, head, labels, chunk_size=7, vocab_size=V)
    ref_grads = torch.autograd.grad(ref, [hidden, head.weight])
    got_grads = torch.autograd.grad(got, [hidden, head.weight])
    assert_only_backend(loss_backends, "own")  # torch's op does not round the logits to bf16
    assert_rel_close(got, ref, 1e-5, "autocast loss")  # same bf16 logits, fp32 loss
    _, ref64_grads = fp64_loss_grads(hidden, head, labels)
    assert_as_accurate_as_upstream(got_grads, ref_grads, ref64_grads, ["hidden grad", "weight grad"])


def test_linear_cross_entropy_dispatch():
    can = ms_loss._can_use_linear_cross_entropy
    h = torch.randn(4, D)
    assert can(nn.Linear(D, V, bias=False), h, None, V)
    assert not can(nn.Linear(D, V, bias=True), h, None, V)
    assert not can(nn.Linear(D, V, bias=False), h, 30.0, V)
    assert not can(nn.Linear(D, V, bias=False).bfloat16(), h.bfloat16(), None, V)
    hooked = nn.Linear(D, V, bias=False)
    hooked.register_forward_hook(lambda *a: None)
    assert not can(hooked, h, None, V)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not can(nn.Linear(D, V, bias=False), h, None, V)


def test_loss_vocab_mismatch_raises():
    head = nn.Linear(D, V + 1, bias=True)
    with pytest.raises(ValueError):
        mini_sequence_causal_lm_loss(
            torch.randn(1, S, D, requires_grad=True), head, make_labels(1, S), chunk_size=7, vocab_size=V
        )


# --------------------------------------------------------------------------- memory


def test_live_tensor_tracker_sees_inside_custom_ops():
    """torch's chunked F.linear_cross_entropy is a `torch.library` custom op: one call to a dispatch mode. Its
    [chunk, V] fp32 logits (here 1024 x 8000 x 4 B = 31.25 MiB) must count; before the tracker ran custom ops'
    bodies under itself, this step read about 4 MiB whatever the chunk size."""
    torch.manual_seed(0)
    hidden = torch.randn(2048, 16, requires_grad=True)
    weight = torch.randn(8000, 16, requires_grad=True)
    labels = torch.randint(0, 8000, (2048,))
    options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=1024, chunking_method=None)
    with LiveTensorTracker() as tracker:
        F.linear_cross_entropy(hidden, weight, labels, reduction="sum", options=options).backward()
    assert tracker.peak_bytes >= 1024 * 8000 * 4


def test_live_tensor_tracker_known_sizes():
    before = torch.randn(1000)  # baseline: not counted
    with LiveTensorTracker() as tracker:
        a = torch.empty(1000)  # 4000 B
        b = torch.empty(500)  # 2000 B -> 6000
        view = a.view(10, 100)  # no new storage
        a.add_(1)  # in place: no new storage
        before.mul_(2)  # in place on a baseline storage: not counted
        del a, view  # frees 4000 -> 2000
        assert tracker.current_bytes == 2000
        c = torch.empty(250)  # 1000 -> 3000
    assert tracker.peak_bytes == 6000
    assert tracker.current_bytes == 3000
    assert tracker.largest_numel == 1000
    assert tracker.largest_shapes[0][:2] == (1000, (1000,))
    del b, c
    # and it can fail: a bigger allocation is seen
    with LiveTensorTracker() as tracker:
        big = torch.zeros(10_000)
        del big
    assert tracker.peak_bytes == 40_000 and tracker.current_bytes == 0


def test_mlp_memory_no_full_intermediate():
    torch.manual_seed(30)
    seq, inter, chunk = 256, 256, 16
    mlp = LlamaMLP(LlamaConfig(hidden_size=D, intermediate_size=inter))
    x = torch.randn(1, seq, D, requires_grad=True)
    g = torch.randn(1, seq, D)

    def peak(fn):
        with LiveTensorTracker() as tracker:
            out = fn(x)
            grads = torch.autograd.grad(out, [x, *mlp.parameters()], g)
            del out, grads
        return tracker

    full = peak(mlp)
    ms = peak(lambda h: mini_sequence_mlp(mlp, h, chunk))
    assert full.largest_numel >= seq * inter  # the tracker does see the [S, I] tensors unsplit
    assert ms.largest_numel < seq * inter, ms.largest_shapes
    assert ms.peak_bytes < 0.5 * full.peak_bytes, (ms.peak_bytes, full.peak_bytes)


def test_loss_memory_no_full_logits(loss_path):
    torch.manual_seed(31)
    n_tokens, vocab, chunk = 256, 512, 16
    head = nn.Linear(D, vocab, bias=False)
    hidden = torch.randn(1, n_tokens, D, requires_grad=True)
    labels = torch.randint(0, vocab, (1, n_tokens))

    def peak(fn):
        with LiveTensorTracker() as tracker:
            loss = fn()
            grads = torch.autograd.grad(loss, [hidden, head.weight])
            del loss, grads
        return tracker

    full = peak(lambda: ForCausalLMLoss(head(hidden), labels, vocab))
    ms = peak(
        lambda: mini_sequence_causal_lm_loss(hidden, head, labels, chunk_size=chunk, vocab_size=vocab)
    )
    assert full.largest_numel >= n_tokens * vocab
    assert ms.largest_numel < n_tokens * vocab, ms.largest_shapes
    assert ms.peak_bytes < 0.5 * full.peak_bytes, (ms.peak_bytes, full.peak_bytes)


def test_loss_bf16_peak_not_above_fp32_path():
    # The bf16 head + loss (our Function) peaks no higher than the fp32 one (torch's
    # linear_cross_entropy). This shape keeps the ratios of the 8192-token, d=512, V=32000 case
    # (scripts/lm_head_memory.py): 1.90 vs 2.20 MiB measured, 4.46 before (an fp32 copy of the
    # [C, V] logits and their fp32 gradient, a bf16 [V, d] gradient per chunk next to the fp32 sum).
    torch.manual_seed(37)
    n_tokens, d, vocab, chunk = 512, 64, 4000, 64
    hidden = torch.randn(1, n_tokens, d)
    labels = torch.randint(0, vocab, (1, n_tokens))
    labels[0, :50] = -100

    def peak(dtype):
        head = nn.Linear(d, vocab, bias=False, dtype=dtype)
        h = hidden.to(dtype).requires_grad_()
        with LiveTensorTracker(keep_largest=10_000) as tracker:
            loss = mini_sequence_causal_lm_loss(h, head, labels, chunk_size=chunk, vocab_size=vocab)
            grads = torch.autograd.grad(loss, [h, head.weight])
            del loss, grads
        return tracker

    fp32, bf16 = peak(torch.float32), peak(torch.bfloat16)
    # No fp32 tensor of a chunk's logits size: the fp32 upcast happens a few rows at a time.
    assert not [r for r in bf16.largest_shapes if r[1] == (chunk, vocab) and "_to_copy" in r[2]]
    assert bf16.peak_bytes <= fp32.peak_bytes, (bf16.peak_bytes / 2**20, fp32.peak_bytes / 2**20)

"""Wrappers that swap or re-home parameters at call time must never lose a gradient.

One-process stand-ins for what FSDP2 (a pre-hook swaps in unsharded parameters), FSDP1
(weights installed as plain views of one flat parameter) and accelerate do; the real wrappers
run in tests/test_distributed.py (2 gloo processes). Each case is checked against the unsplit module on
fresh random inputs, and each stand-in lost its gradient silently before the fix (None).
"""

import logging
import zlib

import pytest
import torch
import transformers
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.mini_sequence import mini_sequence_causal_lm_loss, mini_sequence_mlp
from transformers.mini_sequence.mlp import _MiniSequenceMLPFunction, module_forward
from transformers.mst_core.wrappers import function_parameters

D, I, V, S = 16, 40, 50, 37


def seeded(name):
    torch.manual_seed(zlib.crc32(name.encode()))


def make_mlp():
    config = transformers.LlamaConfig(
        hidden_size=D, intermediate_size=I, num_attention_heads=2, num_key_value_heads=2, mini_sequence_chunk=7
    )
    return transformers.models.llama.modeling_llama.LlamaMLP(config)


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


class SwapInUnsharded:
    """FSDP2-like: the registered parameter is a 'shard'; a pre-hook installs a different, full
    Parameter for the forward and the post-hook puts the shard back. Gradients must reach the
    full parameter that the forward used (FSDP2 reads `.grad` of the unsharded parameter)."""

    def __init__(self, module):
        self.sharded = module.weight
        self.unsharded = nn.Parameter(module.weight.detach().clone())
        module.register_forward_pre_hook(self.pre)
        module.register_forward_hook(self.post)

    def pre(self, module, args):
        module.weight = self.unsharded

    def post(self, module, args, output):
        module.weight = self.sharded


def install_flat_views(linears):
    """FSDP1-like (use_orig_params=False): one flat Parameter; each Linear's weight is removed from
    its parameters and re-installed as a plain tensor view of it before every forward."""
    weights = [m.weight.detach() for m in linears]
    flat = nn.Parameter(torch.cat([w.reshape(-1) for w in weights]))

    def refresh(module, args, offset, shape):
        module.weight = flat[offset : offset + shape.numel()].view(shape)

    offset = 0
    for m, w in zip(linears, weights):
        del m._parameters["weight"]
        m.weight = flat[offset : offset + w.numel()].view(w.shape)
        m.register_forward_pre_hook(lambda mod, args, o=offset, s=w.shape: refresh(mod, args, o, s))
        offset += w.numel()
    return flat


def test_function_parameters_plain_and_wrapped():
    mlp = make_mlp()
    assert function_parameters(mlp) == list(mlp.parameters())
    mlp.up_proj.weight.requires_grad_(False)
    assert function_parameters(mlp) == [mlp.gate_proj.weight, mlp.down_proj.weight]

    hooked = make_mlp()
    hooked.down_proj.register_forward_pre_hook(lambda m, a: None)
    assert function_parameters(hooked) is None

    zero3 = make_mlp()
    zero3.gate_proj.weight.ds_id = 0  # DeepSpeed ZeRO-3 marks its partitioned parameters so
    assert function_parameters(zero3) is None

    forward_replaced = make_mlp()
    forward_replaced.up_proj.forward = forward_replaced.up_proj.forward  # accelerate's add_hook_to_module
    assert function_parameters(forward_replaced) is None


def test_function_parameters_while_compiling_refuse_fsdp1_managed_modules():
    """Under torch.compile a module's `__dict__` is not scanned (dynamo in torch 2.11 breaks the graph there): FSDP1's
    mark on the modules it manages (its views are plain attributes during its forward) refuses them instead."""
    def taken(module):
        @torch.compile(fullgraph=True, backend="eager")
        def probe(x):
            params = function_parameters(module, traced=True)
            return x + (-1 if params is None else len(params))
        return int(probe(torch.zeros(())))

    torch._dynamo.reset()
    mlp = make_mlp()
    assert taken(mlp) == 3
    # as torch.distributed.fsdp._dynamo_utils annotates FSDP1's modules (dynamo traces them with use_orig_params only)
    mlp.up_proj._is_fsdp_managed_module, mlp.up_proj._fsdp_use_orig_params = True, True
    assert taken(mlp) == -1
    assert function_parameters(mlp) == list(mlp.parameters())  # eagerly: no plain attribute, taken


def test_lm_loss_fsdp2_style_swapped_head_gets_its_gradient():
    seeded("fsdp2 head")
    head = nn.Linear(D, V, bias=False)
    hidden = torch.randn(2, S, D, requires_grad=True)
    labels = torch.randint(0, V, (2, S))
    labels[0, :5] = -100

    ref_head = nn.Linear(D, V, bias=False)
    ref_head.weight.data.copy_(head.weight)
    ref_hidden = hidden.detach().clone().requires_grad_()
    logits = ref_head(ref_hidden).float()
    ref = nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1), ignore_index=-100
    )
    ref.backward()

    swap = SwapInUnsharded(head)
    loss = mini_sequence_causal_lm_loss(hidden, head, labels, chunk_size=7, vocab_size=V)
    loss.backward()
    assert rel_err(loss, ref) < 1e-6
    assert swap.unsharded.grad is not None, "the parameter the forward used got no gradient"
    assert rel_err(swap.unsharded.grad, ref_head.weight.grad) < 1e-5
    assert swap.sharded.grad is None  # the shard was not used: the wrapper reduces from unsharded
    assert rel_err(hidden.grad, ref_hidden.grad) < 1e-5


def test_mlp_fsdp2_style_swapped_weight_gets_its_gradient():
    seeded("fsdp2 mlp")
    mlp, ref_mlp = make_mlp(), make_mlp()
    ref_mlp.load_state_dict(mlp.state_dict())
    x = torch.randn(2, S, D, requires_grad=True)
    grad_out = torch.randn(2, S, D)
    ref_x = x.detach().clone().requires_grad_()
    ref_mlp(ref_x).backward(grad_out)

    swap = SwapInUnsharded(mlp.down_proj)
    mini_sequence_mlp(mlp, x, 7).backward(grad_out)
    assert swap.unsharded.grad is not None
    assert rel_err(swap.unsharded.grad, ref_mlp.down_proj.weight.grad) < 1e-5
    assert rel_err(mlp.gate_proj.weight.grad, ref_mlp.gate_proj.weight.grad) < 1e-5
    assert rel_err(x.grad, ref_x.grad) < 1e-5


def test_mlp_fsdp1_style_flat_parameter_gets_its_gradient():
    seeded("fsdp1 mlp")
    mlp, ref_mlp = make_mlp(), make_mlp()
    ref_mlp.load_state_dict(mlp.state_dict())
    linears = [mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    flat = install_flat_views(linears)
    assert list(mlp.parameters()) == []  # what FSDP1 with use_orig_params=False shows the MLP

    x = torch.randn(3, S, D, requires_grad=True)
    grad_out = torch.randn(3, S, D)
    ref_x = x.detach().clone().requires_grad_()
    ref_mlp(ref_x).backward(grad_out)
    mini_sequence_mlp(mlp, x, 7).backward(grad_out)

    assert flat.grad is not None, "flat parameter got no gradient (the reported silent loss)"
    expected = torch.cat([m.weight.grad.reshape(-1) for m in (ref_mlp.gate_proj, ref_mlp.up_proj, ref_mlp.down_proj)])
    assert rel_err(flat.grad, expected) < 1e-5
    assert rel_err(x.grad, ref_x.grad) < 1e-5


def test_wrapped_path_hooks_fire_once_per_parameter():
    # The engine sums a parameter's chunk gradients before accumulating: DDP/FSDP/ZeRO hooks fire once.
    seeded("hooks once")
    mlp = make_mlp()
    swap = SwapInUnsharded(mlp.up_proj)
    calls = {}
    params = {"gate": mlp.gate_proj.weight, "up": swap.unsharded, "down": mlp.down_proj.weight}
    for name, p in params.items():
        p.register_post_accumulate_grad_hook(lambda p, n=name: calls.__setitem__(n, calls.get(n, 0) + 1))
    mini_sequence_mlp(mlp, torch.randn(1, S, D, requires_grad=True), 5).sum().backward()
    assert calls == {"gate": 1, "up": 1, "down": 1}


def test_function_given_too_few_parameters_raises_instead_of_dropping():
    # The guard behind the fast path: a weight used by the computation but not passed in raises.
    seeded("unlisted")
    mlp = make_mlp()
    x = torch.randn(1, S, D, requires_grad=True)
    params = list(mlp.parameters())[:-1]  # down_proj.weight left out
    out = _MiniSequenceMLPFunction.apply(x, 7, module_forward, mlp, True, *params)
    with pytest.raises(RuntimeError, match="would be lost"):
        out.sum().backward()


class CountingLinear(nn.Linear):
    calls = 0

    def forward(self, x):
        CountingLinear.calls += 1
        return super().forward(x)


def test_loss_inside_checkpoint_runs_head_once_per_chunk_not_quadratic():
    # Inside a non-reentrant checkpoint the head runs once per chunk in forward, and the region is
    # not recomputed: the Function divides inside and keeps its gradients on ctx, so backward
    # unpacks no saved tensor. M calls, not M + M * M (nor 2 * M, when a division after the
    # Function saved its output and triggered one recomputation).
    seeded("checkpointed loss")
    head = CountingLinear(D, V, bias=False)
    hidden = torch.randn(1, 64, D, requires_grad=True)
    labels = torch.randint(0, V, (1, 64))
    num_chunks = 8

    def loss_fn(h):
        return mini_sequence_causal_lm_loss(h, head, labels, chunk_size=64 // num_chunks, vocab_size=V)

    ref_hidden = hidden.detach().clone().requires_grad_()
    ref = loss_fn(ref_hidden)
    ref.backward()
    CountingLinear.calls = 0
    loss = checkpoint(loss_fn, hidden, use_reentrant=False)
    loss.backward()
    assert CountingLinear.calls == num_chunks
    assert rel_err(loss, ref) < 1e-6 and rel_err(hidden.grad, ref_hidden.grad) < 1e-5


@pytest.mark.parametrize("what", ["mlp", "loss", "wrapped loss"])
def test_double_backward_raises(what):
    seeded("double " + what)
    x = torch.randn(1, S, D, requires_grad=True)
    if what == "mlp":
        mlp = make_mlp()
        out, params = mini_sequence_mlp(mlp, x, 7).square().sum(), list(mlp.parameters())
    else:
        head = CountingLinear(D, V, bias=False)  # not a plain nn.Linear: our Function, not torch's
        if what == "wrapped loss":  # the checkpointed chunks' cross-entropy Function
            head = nn.Linear(D, V, bias=False)
            params = [SwapInUnsharded(head).unsharded]
        out = mini_sequence_causal_lm_loss(x, head, torch.randint(0, V, (1, S)), chunk_size=7, vocab_size=V)
        params = params if what == "wrapped loss" else list(head.parameters())
    # Refused at the first backward: returning gradients without a graph would make a gradient
    # penalty's own gradient silently zero.
    with pytest.raises(RuntimeError, match="create_graph=True"):
        torch.autograd.grad(out, [x, *params], create_graph=True)


def gated_mlp_reference(mlp, x):
    """The gated MLP formula, spelled out here as the test's reference (the package calls the module's own forward)."""
    return mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))


def test_mlp_built_from_config_without_the_field():
    # Draft heads and derived models build LlamaMLP & co from configs that lack the field.
    config = transformers.PretrainedConfig(hidden_size=D, intermediate_size=I, hidden_act="silu", mlp_bias=False)
    for cls in (
        transformers.models.llama.modeling_llama.LlamaMLP,
        transformers.models.qwen2.modeling_qwen2.Qwen2MLP,
        transformers.models.mistral.modeling_mistral.MistralMLP,
    ):
        mlp = cls(config)
        x = torch.randn(1, 5, D)
        assert torch.equal(mlp(x), gated_mlp_reference(mlp, x))
    gemma = transformers.models.gemma2.modeling_gemma2.Gemma2MLP(
        transformers.PretrainedConfig(hidden_size=D, intermediate_size=I, hidden_activation="gelu_pytorch_tanh")
    )
    x = torch.randn(1, 5, D)
    assert torch.equal(gemma(x), gated_mlp_reference(gemma, x))


def test_composite_model_with_flag_on_text_config_warns(caplog):
    text = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, mini_sequence_chunk=8,
    )
    vision = transformers.CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, image_size=32, patch_size=16
    )
    config = transformers.LlavaConfig(text_config=text, vision_config=vision, image_token_id=63)
    with caplog.at_level(logging.WARNING):
        transformers.LlavaForConditionalGeneration(config)
    assert "text_config.mini_sequence_chunk=8" in caplog.text
    assert "LlavaForConditionalGeneration computes its LM head" in caplog.text


def test_wrapped_lm_loss_peak_equals_function_path_in_bf16(monkeypatch):
    """On the wrapper path (a head whose weight a wrapper swaps: ZeRO-3, FSDP) each checkpointed chunk's loss
    is computed a few rows at a time in fp32, as the Function path does: no fp32 copy of a chunk's [C, V]
    logits, no fp32 log-probabilities or gradient (upstream's `F.cross_entropy(logits.float())` in the chunk
    held them: 2.6x the Function path's peak here, now 1.2x: what is left is the [V, d] weight gradient of
    one chunk that autograd builds before adding it into `.grad`). Same loss and hidden-state gradient as
    the Function path. The Function path here is the accumulating one: with more vocabulary rows than tokens a
    plain bf16 head would take the vocabulary-sliced backward, which holds no fp32 [V, d] sum at all (compared
    with the accumulating Function in test_mini_sequence_core.py)."""
    from transformers.mini_sequence import loss as ms_loss
    from transformers.mst_core.memory import LiveTensorTracker

    monkeypatch.setattr(ms_loss, "_vocab_sliced_backward_pays", lambda *args: False)

    seeded("wrapped bf16 peak")
    n, d, v, chunk = 512, 64, 8000, 128
    head = nn.Linear(d, v, bias=False).to(torch.bfloat16)
    hidden = torch.randn(1, n, d, dtype=torch.bfloat16)
    labels = torch.randint(0, v, (1, n))
    labels[0, :40] = -100
    results = {}
    for path in ("function", "wrapped"):
        if path == "wrapped":
            swap = SwapInUnsharded(head)
        x = hidden.clone().requires_grad_()
        with LiveTensorTracker(keep_largest=0) as tracker:
            loss = mini_sequence_causal_lm_loss(x, head, labels, chunk_size=chunk, vocab_size=v)
            loss.backward()
        results[path] = (loss.detach(), x.grad, tracker.peak_bytes)
    (f_loss, f_grad, f_peak), (w_loss, w_grad, w_peak) = results["function"], results["wrapped"]
    assert swap.unsharded.grad is not None
    assert rel_err(w_loss, f_loss) < 1e-6 and rel_err(w_grad.float(), f_grad.float()) < 1e-2
    assert w_peak <= 1.25 * f_peak, (w_peak, f_peak)

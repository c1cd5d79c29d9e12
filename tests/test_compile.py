"""torch.compile with our fields set.

mini_sequence_chunk: a training step compiles with `fullgraph=True` (no graph break at all, as with the fields
unset) and its loss and gradients equal the eager unsplit step's; the MLP, MoE block and norms are each one operator of
the graph (mini_sequence/compiled.py), and keep the eager step's memory; where dropout draws inside the block, the
recomputation of a chunk under compile replays the forward's masks. streaming_backward_chunk: each streamed layer call
is one operator of the graph (streaming_backward/compiled.py), exact."""

import re

import pytest
import torch

from tiny_models import make_model
from transformers.mini_sequence import mini_sequence_mlp

S = 200  # against chunks of 48: uneven, the last one short
NO_ATTENTION = ("mamba2",)  # no attention layers: upstream refuses an `attn_implementation`


def batch(seed=0):
    """Two rows, the second left-padded; padding and some leading tokens of the first ignored in the labels."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 128, (2, S), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :37] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, :20] = -100
    return ids, mask, labels


def loss_of(model, ids, mask, labels):
    return model(input_ids=ids, attention_mask=mask, labels=labels).loss


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def train_step(family, step, checkpointing=False, **fields):
    # use_cache=False: upstream warns (logger.warning_once, not traceable) when a checkpointed model is asked to cache.
    attention = {} if family in NO_ATTENTION else dict(attn_implementation="sdpa")
    model = make_model(family, seed=1, use_cache=False, **attention, **fields).train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    torch._dynamo.reset()
    loss = step(model, *batch())
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
    missing = [name for name, grad in grads.items() if grad is None]
    assert not missing, f"no gradient for {missing}"
    return loss.detach(), grads


def assert_same_step(got, ref, tol=1e-5, skip=()):
    """Loss and every gradient within `tol` (relative); `skip`: name endings of gradients left out."""
    (loss, grads), (ref_loss, ref_grads) = got, ref
    assert rel_err(loss, ref_loss) < tol, (loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    grads = {name: grad for name, grad in grads.items() if not name.endswith(skip)}
    worst = max(grads, key=lambda name: rel_err(grads[name], ref_grads[name]))
    assert rel_err(grads[worst], ref_grads[worst]) < tol, (worst, rel_err(grads[worst], ref_grads[worst]))


@pytest.mark.parametrize("family,checkpointing", [("llama", False), ("llama", True), ("qwen3", False)])
def test_mini_sequence_compiles_fullgraph_and_is_exact(family, checkpointing):
    """`fullgraph=True` raises at the first graph break: the step has none. (At mst.9 it had 12, from the chunked
    Functions, whose backward calls autograd.grad, and the first-step check's hook removal.)"""
    ref = train_step(family, loss_of, checkpointing)
    compiled = train_step(family, torch.compile(loss_of, fullgraph=True), checkpointing, mini_sequence_chunk=48)
    assert_same_step(compiled, ref)


def test_mini_sequence_mlp_under_compile_replays_dropout_masks():
    """LoRA dropout inside the MLP: the compiled chunked MLP must give the gradient of the masks its forward drew.
    Reference: the same chunks under plain autograd, eagerly; inductor draws with eager's random ops
    (`fallback_random`), so both forwards draw the same masks, and a recomputation that drew new ones would
    change the gradients (checked below: they differ from the dropout-free ones)."""
    import peft

    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    mlp = LlamaMLP(make_model("llama").config)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.3, target_modules=["gate_proj", "up_proj", "down_proj"])
    mlp = peft.inject_adapter_in_model(config, mlp).train()
    for name, p in mlp.named_parameters():
        if "lora_B" in name:  # LoRA B starts at zero; make the adapter contribute
            torch.nn.init.normal_(p, std=0.1)
    params = [p for p in mlp.parameters() if p.requires_grad]
    x = torch.randn(2, S, 32, requires_grad=True)
    weights = torch.randn(2, S, 32)

    def chunks_by_autograd(x):
        return torch.cat([mlp(x[:, start : start + 48]) for start in range(0, S, 48)], dim=1)

    def grads_of(fn, seed, compiled=True):
        torch._dynamo.reset()
        torch.manual_seed(seed)
        with torch._inductor.config.patch(fallback_random=True):
            out = torch.compile(fn, fullgraph=True)(x) if compiled else fn(x)
            return [out, *torch.autograd.grad((out * weights).sum(), [x, *params])]

    # The reference runs eagerly: torch 2.11 compiles the plain chunks' dropout to other draws than eager (0.57 apart
    # in the forward), where ours draws eager's masks, as on torch 2.13.
    ref = grads_of(chunks_by_autograd, 5, compiled=False)
    got = grads_of(lambda x: mini_sequence_mlp(mlp, x, 48), 5)
    for a, b in zip(got, ref):
        assert rel_err(a, b) < 1e-5
    other_masks = grads_of(chunks_by_autograd, 6, compiled=False)
    assert max(rel_err(a, b) for a, b in zip(other_masks[1:], ref[1:])) > 0.05  # dropout really draws


@pytest.mark.parametrize("family,fields", [
    ("llama", dict(streaming_backward_chunk=48)),
    ("qwen3", dict(streaming_backward_chunk=48, mini_sequence_chunk=48)),
    ("phi3", dict(streaming_backward_chunk=48)),
    ("gemma3_text", dict(streaming_backward_chunk=48, mini_sequence_chunk=48)),
    ("gemma4_text", dict(streaming_backward_chunk=48, mini_sequence_chunk=48)),
])
def test_streaming_compiles_fullgraph_and_is_exact(family, fields):
    """Streamed layers (the layer's own forward per chunk, streaming_backward/) under torch.compile: each layer call is
    one operator of the graph (streaming_backward/compiled.py), so `fullgraph=True` trains, exact against the eager
    unsplit step (left padding: a blind first chunk; uneven chunks). Until mst.18 each call ran eagerly, one graph
    break per call (5 on a 2-layer Llama); traced, at mst.17, it broke on the mask's `.item()`, the exception that
    stops a K/V pass, and upstream's collector variable. Gemma-4's layers take positional arguments, a per-layer input
    that requires grad (a row input of the operator, its gradient returned) and a `KVSharingDict` (a fresh one per
    chunk): they ran eagerly, one graph break each, until 5.24.0+mst.39."""
    ref = train_step(family, loss_of)
    compiled = train_step(family, torch.compile(loss_of, fullgraph=True), **fields)
    assert_same_step(compiled, ref)


@pytest.mark.parametrize("family,fields", [
    ("mamba2", dict(streaming_backward_chunk=48)),
    ("qwen3_next", dict(streaming_backward_chunk=48, mini_sequence_chunk=48)),
    ("falcon_h1", dict(streaming_backward_chunk=48)),
    ("nemotron_h", dict(streaming_backward_chunk=48, mini_sequence_chunk=48)),
    ("jamba", dict(streaming_backward_chunk=48)),
])
def test_streamed_recurrent_layers_compile_fullgraph_and_are_exact(family, fields):
    """Layers that stream through their recurrent state (Mamba2's, Qwen3-Next's Gated DeltaNet, Jamba's Mamba through
    the adjoint scan's seam), a hybrid's blocks that mix no tokens (Nemotron-H's MLP and MoE), and a mixer beside
    attention (Falcon-H1) are one operator of the graph each, as attention layers are: `fullgraph=True` trains, exact
    against the eager unsplit step (left padding, uneven chunks). Until 5.24.0+mst.39 each of their calls ran eagerly,
    one graph break per call (and `fullgraph=True` failed). Gated DeltaNet's decay gradients (`A_log`, `dt_bias`) are
    sums of nearly cancelling terms, moved by fp32 rounding alone as far as 3.5e-3 in upstream's own step
    (tests/test_new_families.py, FP64_CHECKED): against the eager streamed step here, whose kernels the operator runs,
    within that file's 1e-4 for them (the compiled embedding, norm and head round otherwise), and held to fp64 by
    tests/test_streaming_recurrent.py."""
    ref = train_step(family, loss_of)
    compiled = train_step(family, torch.compile(loss_of, fullgraph=True), **fields)
    decay = ("linear_attn.dt_bias", "linear_attn.A_log") if family == "qwen3_next" else ()
    assert_same_step(compiled, ref, skip=decay)
    if decay:
        eager = train_step(family, loss_of, **fields)[1]
        for name in (name for name in eager if name.endswith(decay)):
            assert rel_err(compiled[1][name], eager[name]) < 1e-4, name


@pytest.mark.parametrize("family", ["llama", "granitemoehybrid", "falcon_h1"])
def test_streaming_compiled_with_the_models_own_cache(family):
    """With `use_cache=True` (the configs' default) the model makes an empty cache and hands it to every layer, which a
    streamed call neither reads nor fills (docs/streaming.md): the call is one operator of the graph all the same,
    `fullgraph=True` trains, exact. Until 5.24.0+mst.39 such a call did not cross the operator: every layer call ran
    eagerly (10 graph breaks on the tiny Llama). A cache that holds tokens is still refused, compiled too."""
    def step(compiled, **fields):
        attention = {} if family in NO_ATTENTION else dict(attn_implementation="sdpa")
        model = make_model(family, seed=1, use_cache=True, **attention, **fields).train()
        torch._dynamo.reset()
        loss = (torch.compile(loss_of, fullgraph=True) if compiled else loss_of)(model, *batch())
        loss.backward()
        return loss.detach(), {name: p.grad for name, p in model.named_parameters()}

    assert_same_step(step(True, streaming_backward_chunk=48), step(False))
    if family == "llama":
        model = make_model(family, seed=1, attn_implementation="sdpa", streaming_backward_chunk=48).train()
        ids = batch()[0]
        with torch.no_grad():
            cache = model(input_ids=ids[:, :5], use_cache=True).past_key_values
        torch._dynamo.reset()
        with pytest.raises(ValueError, match="holds 5 cached tokens"):
            torch.compile(lambda: model(input_ids=ids[:, 5:], labels=ids[:, 5:], past_key_values=cache).loss)()


def test_streamed_operator_takes_no_other_input_that_requires_grad_but_rows():
    """The operator differentiates the hidden states, the parameters and the call's row inputs that require grad
    (Gemma-4's per-layer input: test_streaming_compiles_fullgraph_and_is_exact). A call with another tensor that requires
    grad runs eagerly (the caller gets None here), so that tensor's gradient is not dropped."""
    from transformers.streaming_backward import compiled

    model = make_model("llama", seed=1, attn_implementation="sdpa", use_cache=False, streaming_backward_chunk=48)
    model.train()
    hidden = torch.randn(1, 64, model.config.hidden_size, requires_grad=True)
    arguments = dict(position_embeddings=model.model.rotary_emb(hidden, torch.arange(64)[None]), scale=torch.ones(4))
    assert compiled.traced_call(model.model.layers[0], (hidden,), arguments) is not None  # crosses
    arguments["scale"].requires_grad_()
    assert compiled.traced_call(model.model.layers[0], (hidden,), arguments) is None


def test_compiled_streamed_layer_gives_zeros_to_parameters_of_uncalled_modules():
    """Jamba's Mamba mixer reads `dt_proj.weight` without calling the module, so a LoRA adapter on `dt_proj` gets no
    gradient in upstream's step and in the eager streamed one. The compiled operator returns a tensor per parameter:
    zeros for those (every other adapter as in the eager streamed step, which equals upstream's). Only adapters after
    the conv train here, so the conv states carried between chunks have no graph: until mst.39 the streamed backward
    raised on them ("element 1 of tensors does not require grad"), eagerly too."""
    from peft import LoraConfig, get_peft_model

    def lora_step(step, **fields):
        model = make_model("jamba", seed=1, use_cache=False, attn_implementation="sdpa", **fields).train()
        # Random A and B (PEFT's default B = 0 would leave every A without a gradient): the same draws each run.
        config = LoraConfig(r=2, target_modules=["dt_proj", "x_proj"], lora_dropout=0.0, init_lora_weights=False)
        model = get_peft_model(model, config)
        torch._dynamo.reset()
        step(model, *batch()).backward()
        return {name: p.grad for name, p in model.named_parameters() if p.requires_grad}

    unset = lora_step(loss_of)
    eager = lora_step(loss_of, streaming_backward_chunk=48)
    compiled = lora_step(torch.compile(loss_of, fullgraph=True), streaming_backward_chunk=48)
    uncalled = [name for name in eager if "dt_proj.lora" in name]
    assert uncalled and all(unset[name] is None and eager[name] is None for name in uncalled)
    assert all(not compiled[name].any() for name in uncalled)
    called = [name for name in eager if "x_proj.lora" in name]
    assert called and all(eager[name].abs().max() > 0 for name in called)
    assert all(rel_err(eager[name], unset[name]) < 1e-5 for name in called)
    assert all(rel_err(compiled[name], eager[name]) < 1e-5 for name in called)


def test_zamba2_compiles_fullgraph_and_is_exact():
    """Zamba2 under torch.compile with `fullgraph=True`: its hybrid layers take the embeddings, which require grad, as a
    row input of the operator (since 5.24.0+mst.39), and so do its Mamba2 layers, which are passed them and never read
    them (since 5.24.0+mst.41; before, each of their calls ran eagerly, one graph break each). Exact against the eager
    unsplit step (a right-padded batch, as Zamba2's streamed hybrid layers need)."""

    def right_padded(model, ids, mask, labels):
        mask, labels = torch.flip(mask, dims=[1]), torch.flip(labels, dims=[1])
        return loss_of(model, ids, mask, labels)

    ref = train_step("zamba2", right_padded)
    compiled = train_step("zamba2", torch.compile(right_padded, fullgraph=True), streaming_backward_chunk=48)
    assert_same_step(compiled, ref)


def test_streaming_compiled_replays_dropout_and_autocast():
    """Attention dropout: the compiled step's gradients are those of the masks its forward drew (equal to the eager
    streamed step from the same seed, and not to another seed's). Autocast: the operator's kernel runs the layer under
    the autocast state of the traced call (a compiled graph has no autocast context at run time)."""
    fields = dict(streaming_backward_chunk=48, attention_dropout=0.3)

    def seeded(step, seed):
        def run(model, *inputs):
            torch.manual_seed(seed)
            return step(model, *inputs)

        return run

    compiled = train_step("llama", seeded(torch.compile(loss_of, fullgraph=True), 5), **fields)
    eager = train_step("llama", seeded(loss_of, 5), **fields)
    other = train_step("llama", seeded(loss_of, 6), **fields)
    assert_same_step(compiled, eager)
    assert max(rel_err(other[1][n], eager[1][n]) for n in eager[1]) > 0.05  # dropout really draws

    dtypes = []
    model = make_model("llama", seed=1, attn_implementation="sdpa", use_cache=False, streaming_backward_chunk=48).train()
    projection = model.model.layers[0].mlp.down_proj
    projection.register_forward_hook(lambda module, args, out: dtypes.append(out.dtype))
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = torch.compile(loss_of, fullgraph=True)(model, *batch())
    loss.backward()
    assert dtypes and set(dtypes) == {torch.bfloat16}, dtypes  # forward chunks and their recompute


def test_streaming_compiled_two_calls_before_one_backward():
    """Two forwards of the model, then one backward of their summed losses: each layer call's backward finds its own
    forward's state (a token per call, whatever order autograd runs them in)."""

    def two_losses(model, ids, mask, labels):
        other = torch.flip(ids, dims=[1])
        return loss_of(model, ids, mask, labels) + 0.5 * loss_of(model, other, torch.ones_like(mask), other)

    ref = train_step("llama", two_losses)
    compiled = train_step("llama", torch.compile(two_losses, fullgraph=True), streaming_backward_chunk=48)
    assert_same_step(compiled, ref)


def test_streaming_compiled_deepcopy_runs_its_own_layers():
    """`copy.deepcopy` copies a layer's key with its attributes; the copy's calls must run the copy's layers (with
    its own, here changed, weights), not the registered original's: they take the eager call, exact."""
    import copy

    original = make_model("llama", seed=1, attn_implementation="sdpa", use_cache=False, streaming_backward_chunk=48)
    twin = copy.deepcopy(original).train()
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(1.1)
    reference = make_model("llama", seed=1, attn_implementation="sdpa", use_cache=False).train()
    reference.load_state_dict(twin.state_dict())
    ref_loss = loss_of(reference, *batch())
    ref_loss.backward()
    torch._dynamo.reset()
    loss = torch.compile(loss_of)(twin, *batch())
    loss.backward()
    assert_same_step(
        (loss.detach(), {n: p.grad for n, p in twin.named_parameters()}),
        (ref_loss.detach(), {n: p.grad for n, p in reference.named_parameters()}),
    )


def test_streaming_under_compile_falls_back_to_eager_call():
    """A call the operator cannot take (here: a model whose field was set after construction, so its layers have no
    key) runs eagerly, one graph break per call, still exact."""
    from torch._dynamo.utils import counters

    def late_field(model, *inputs):
        return loss_of(model, *inputs)

    ref = train_step("llama", loss_of)
    model = make_model("llama", seed=1, attn_implementation="sdpa", use_cache=False).train()
    model.config.streaming_backward_chunk = 48
    torch._dynamo.reset()
    counters.clear()
    loss = torch.compile(late_field)(model, *batch())
    loss.backward()
    reasons = list(counters["graph_break"])
    assert reasons and all("_eager_forward" in reason and "disable" in reason for reason in reasons), reasons
    assert_same_step((loss.detach(), {n: p.grad for n, p in model.named_parameters()}), ref)


@pytest.mark.parametrize("fields,checkpointing", [
    (dict(mini_sequence_chunk=48), False), (dict(mini_sequence_chunk=48), True),
    (dict(streaming_backward_chunk=48), False), (dict(mini_sequence_chunk=48, streaming_backward_chunk=48), False),
], ids=["mini_sequence", "mini_sequence+checkpointing", "streaming", "both"])
def test_moe_router_aux_loss_under_compile_is_exact(fields, checkpointing):
    """Mixtral with `output_router_logits=True` (the aux loss in the loss) compiled: every layer's logits reach the
    aux loss, exact against the eager unsplit step, and the compiled step breaks its graph no more often than with the
    fields unset (upstream's own breaks: 9 here). At mst.20 it broke 20 times with `mini_sequence_chunk`: the chunks'
    router-logit collectors (mst_core/router_logits.own_router_collector), set inside checkpoint regions, made dynamo
    skip the frame; and more with `streaming_backward_chunk` (15 against 8 without padding), each layer call running
    eagerly."""
    from torch._dynamo.utils import counters

    def loss_and_aux(model, ids, mask, labels):
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        return out.loss, out.aux_loss

    def run(step, **more):
        model = make_model("mixtral", seed=1, attn_implementation="sdpa", use_cache=False, output_router_logits=True,
                           **more).train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        torch._dynamo.reset()
        counters.clear()
        loss, aux = step(model, *batch())
        loss.backward()
        breaks = sum(counters["graph_break"].values())
        return (loss.detach(), aux.detach()), {name: p.grad for name, p in model.named_parameters()}, breaks

    (ref_loss, ref_aux), ref_grads, _ = run(loss_and_aux)
    *_, unset_breaks = run(torch.compile(loss_and_aux))
    (loss, aux), grads, breaks = run(torch.compile(loss_and_aux), **fields)
    assert ref_aux > 0 and rel_err(aux, ref_aux) < 1e-5, (aux, ref_aux)
    assert_same_step((loss, grads), (ref_loss, ref_grads))
    assert breaks <= unset_breaks, (breaks, unset_breaks)


def test_streaming_compiled_router_logits_shape_checked(monkeypatch):
    """The compiled graph is traced with the router logits' shape known before the layer runs (the experts: rows of the
    router's weight, streaming_backward/router.experts_recorded); where the layer records another, the operator's
    kernel raises, naming both, instead of handing the aux loss a tensor of the wrong shape."""
    from transformers.streaming_backward import router

    monkeypatch.setattr(router, "experts_recorded", lambda key: 5)  # the tiny Mixtral has 4 experts
    model = make_model("mixtral", seed=1, attn_implementation="sdpa", use_cache=False, output_router_logits=True,
                       streaming_backward_chunk=48).train()
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match=r"recorded logits of shape \(400, 4\).*expected \(400, 5\)"):
        torch.compile(loss_of)(model, *batch())


@pytest.mark.parametrize("setup", ["bf16", "bf16_vocab_sliced", "autocast"])
def test_mini_sequence_compiled_bf16_within_upstream_bf16_error(monkeypatch, setup):
    """Half precision: under compile the MLP's, norms' and LM head's parameter gradients are summed in fp32 as eagerly
    (their operators run the eager chunks and backward); against an fp64 reference the compiled step's errors stay
    within upstream's own eager errors (measured at mst.20, every sum in bf16: median 7.3e-3 vs 7.5e-3, max 1.03e-2
    vs 1.04e-2). The LM head + loss is one operator (mini_sequence/compiled.py) in each setup: a bf16 head with more
    tokens than vocabulary rows (the gradients computed in the forward, loss.py `loss_and_grads`), with fewer (the
    vocabulary-sliced backward), and an fp32 model under CPU autocast (its head's gradients through autograd; the
    backward inside the autocast context too: the kernels' casts must not be cached for the backward's)."""
    vocab = {"bf16_vocab_sliced": 1024}.get(setup)  # 400 tokens: fewer than 1024 rows, more than the tiny 128
    dtype = torch.float32 if setup == "autocast" else torch.bfloat16

    def step_in(dtype, step, autocast=False, **fields):
        if vocab:
            fields["vocab_size"] = vocab
        model = make_model("llama", seed=1, attn_implementation="sdpa", use_cache=False, **fields).to(dtype).train()
        torch._dynamo.reset()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):  # the backward too, as users may write it
            loss = step(model, *batch())
            (2.5 * loss).backward()  # the loss's incoming gradient scales the operator's precomputed ones
        return loss.detach(), {name: p.grad for name, p in model.named_parameters()}

    def errors(got, ref):
        grads = sorted(rel_err(got[1][name], ref[1][name]) for name in ref[1])
        return rel_err(got[0], ref[0]), grads[len(grads) // 2], grads[-1]

    ref = step_in(torch.float64, loss_of)
    upstream = errors(step_in(dtype, loss_of, setup == "autocast"), ref)
    calls = _loss_operator_calls(monkeypatch)
    compiled = step_in(dtype, torch.compile(loss_of, fullgraph=True), setup == "autocast", mini_sequence_chunk=48)
    assert calls == {"sliced": int(setup == "bf16_vocab_sliced"), "with_grads": int(setup != "bf16_vocab_sliced")}
    for ours, theirs in zip(errors(compiled, ref), upstream):
        assert ours <= 1.5 * theirs + 1e-4, (errors(compiled, ref), upstream)


def _loss_operator_calls(monkeypatch):
    """How many times the LM-head operator's forward kernel ran, by the loss.py function it runs (which a compiled
    training step calls nowhere else)."""
    from transformers.mini_sequence import loss

    calls = {"sliced": 0, "with_grads": 0}
    for kind, name in (("sliced", "sliced_loss"), ("with_grads", "loss_and_grads")):
        def counted(*args, __kind=kind, __function=getattr(loss, name), **kwargs):
            calls[__kind] += 1
            return __function(*args, **kwargs)

        monkeypatch.setattr(loss, name, counted)
    return calls


def _operator_calls(monkeypatch):
    """How many times the mini-sequence operator's forward kernel ran (mini_sequence/compiled.py: it runs the chunks
    through mlp.py's `_forward_chunks`, which a compiled training step calls nowhere else)."""
    from transformers.mini_sequence import mlp

    calls, forward_chunks = [0], mlp._forward_chunks

    def counted(*args, **kwargs):
        calls[0] += 1
        return forward_chunks(*args, **kwargs)

    monkeypatch.setattr(mlp, "_forward_chunks", counted)
    return calls


# Operator calls per step: each layer's block and the final norm; with checkpointing, the last layer's block once more
# (inductor's partitioner recomputes the checkpointed layer's output, which the final norm's backward reads).
# The LM head + loss: one operator where torch's fused linear_cross_entropy does not apply (the tiny Gemma-3's
# soft-capping).
# torch 2.13 has F.linear_cross_entropy, which a plain fp32 head takes (mini_sequence/loss.py); before, our operator
OWN_HEAD_OPERATOR = int(not hasattr(torch.nn.functional, "linear_cross_entropy"))


@pytest.mark.parametrize("family,checkpointing,operators,loss_operators", [
    ("llama", True, 4, OWN_HEAD_OPERATOR),  # each layer's MLP; the plain fp32 head takes linear_cross_entropy
    ("gemma3_text", True, 4, 1),  # each layer's MLP with its post-feedforward norm, one operator; soft-capped head
    ("qwen3_moe", False, 3, OWN_HEAD_OPERATOR),  # each layer's MoE block
])
def test_mini_sequence_blocks_are_one_operator_each_under_compile(
    monkeypatch, family, checkpointing, operators, loss_operators
):
    """Under torch.compile the mini-sequence MLP, MoE block, norms and LM head + loss are each one `torch.library`
    operator of the graph whose kernels run the eager chunks (mini_sequence/compiled.py): `fullgraph=True` trains,
    exact against the eager unsplit step (uneven chunks, left padding), and every block went through the operator."""
    ref = train_step(family, loss_of, checkpointing)
    calls, loss_calls = _operator_calls(monkeypatch), _loss_operator_calls(monkeypatch)
    compiled = train_step(family, torch.compile(loss_of, fullgraph=True), checkpointing, mini_sequence_chunk=48)
    assert calls[0] == operators, calls
    assert loss_calls == {"sliced": 0, "with_grads": loss_operators}, loss_calls
    assert_same_step(compiled, ref)


def _compiled_step_peak(model, ids):
    """Peak bytes above the start of a compiled training step's second call: torch.profiler's memory timeline
    (inductor's buffers included)."""
    import json
    import tempfile
    from pathlib import Path

    from torch.profiler import ProfilerActivity, profile

    torch._dynamo.reset()
    step = torch.compile(loss_of, fullgraph=True)
    step(model, ids, None, ids).backward()  # compiles
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        step(model, ids, None, ids).backward()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "timeline.json"
        prof.export_memory_timeline(str(path), device="cpu")
        _, sizes = json.loads(path.read_text())
    totals = [sum(at) for at in sizes]
    return max(totals) - totals[0]


def test_mini_sequence_operator_keeps_the_eager_memory(monkeypatch):
    """The point of the operator: traced as checkpointed chunks, the compiled backward rebuilt every chunk of the MLP
    before backpropagating through any (the whole sequence's intermediates live together); through the operator one
    chunk at a time. Peak bytes above the step's start, torch.profiler's memory timeline (inductor's buffers
    included), one layer with a wide MLP, 1024 tokens in chunks of 64: the operator's step must peak lower than the
    same step traced as checkpointed chunks by at least two whole-sequence [1024, 1024] fp32 intermediates."""
    from transformers.mini_sequence import mlp

    ids = torch.randint(1, 128, (1, 1024), generator=torch.Generator().manual_seed(0))

    def peak(**patches):
        for name, value in patches.items():
            monkeypatch.setattr(mlp, name, value)
        model = make_model("llama", seed=1, attn_implementation="sdpa", use_cache=False, num_hidden_layers=1,
                           intermediate_size=1024, mini_sequence_chunk=64).train()
        model.gradient_checkpointing_enable()
        result = _compiled_step_peak(model, ids)
        monkeypatch.undo()
        return result

    calls = _operator_calls(monkeypatch)
    through_operator = peak()
    assert calls[0] == 2 * 3, calls  # two steps: the MLP, the final norm, the MLP's recompute (above)
    as_checkpointed_chunks = peak(traced_chunks=lambda *args: None)
    assert through_operator < as_checkpointed_chunks - 2 * 1024 * 1024 * 4, (through_operator, as_checkpointed_chunks)


def test_mini_sequence_loss_operator_keeps_the_eager_memory(monkeypatch):
    """The LM head + loss as one operator: traced as checkpointed chunks, a compiled step held every chunk's logits at
    once; through the operator one chunk's. One layer, V=16384, 1024 tokens in chunks of 64, each path of the
    operator: a bf16 model (the vocabulary-sliced backward) and an fp32 one under CPU autocast, its backward too (the
    gradients computed in the forward): the operator's step must peak lower than the step traced as checkpointed
    chunks by at least half the whole [1024, 16384] bf16 logits (measured: 7.2 against 27.7 MiB, 13.1 against 35.9)."""
    from transformers.mini_sequence import loss

    vocab = 16384
    ids = torch.randint(1, vocab, (1, 1024), generator=torch.Generator().manual_seed(0))

    def peak(path, **patches):
        for name, value in patches.items():
            monkeypatch.setattr(loss, name, value)
        calls = _loss_operator_calls(monkeypatch)
        model = make_model("llama", seed=1, attn_implementation="sdpa", use_cache=False, num_hidden_layers=1,
                           vocab_size=vocab, mini_sequence_chunk=64).train()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=path == "with_grads"):
            result = _compiled_step_peak(model.to(torch.bfloat16) if path == "sliced" else model, ids)
        monkeypatch.undo()
        return result, calls

    for path in ("sliced", "with_grads"):
        through_operator, calls = peak(path)
        assert calls[path] == 2, calls
        as_checkpointed_chunks, calls = peak(path, traced_loss=lambda *args: None)
        assert calls == {"sliced": 0, "with_grads": 0}, calls
        logits_bytes = 1024 * vocab * 2
        assert through_operator < as_checkpointed_chunks - logits_bytes / 2, (path, through_operator, as_checkpointed_chunks)


def test_mini_sequence_operators_pass_opcheck():
    """torch.library.opcheck on the mini-sequence operator (schema, fake tensor, autograd registration) with a
    registered MLP, as the compiled graph calls it. Not opcheck's AOT-dispatch test: it hands the operator copies of
    the parameters, and the kernel computes with the module's own (the operator's inputs name them for autograd), so
    its backward refuses them (mst_core/wrappers.py `check_graph_inputs`: a gradient would be lost)."""
    from transformers.mini_sequence import compiled
    from transformers.mst_core.custom_ops import module_key

    model = make_model("llama", seed=1, mini_sequence_chunk=48).train()
    mlp = model.model.layers[0].mlp
    x = torch.randn(2, 100, model.config.hidden_size, requires_grad=True)
    params = list(mlp.parameters())
    text = f"@out=float32,{model.config.hidden_size}"
    torch.library.opcheck(compiled.mini_sequence_chunks, (x, params, [module_key(mlp)], "mlp", 48, text),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


@pytest.mark.parametrize("dtype,vocab,softcap,sliced", [
    (torch.bfloat16, 512, None, True),  # fewer tokens than vocabulary rows: the vocabulary-sliced backward operator
    (torch.bfloat16, 512, 30.0, True),  # the same, soft-capped
    (torch.float32, 128, 30.0, False),  # the gradients computed in the forward
    (torch.bfloat16, 128, None, False),  # the same, the weight's summed in fp32
])
def test_mini_sequence_loss_operators_pass_opcheck(dtype, vocab, softcap, sliced):
    """torch.library.opcheck on the LM-head operators as the compiled graph calls them (schema, fake tensor, autograd
    registration; not the AOT-dispatch test, as above)."""
    from transformers.mini_sequence import compiled
    from transformers.mst_core.custom_ops import module_key

    head = torch.nn.Linear(32, vocab, bias=False).to(dtype)
    compiled.name_modules([head])
    hidden = torch.randn(200, 32, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, vocab, (200,))
    labels[:30] = -100
    divisor = (labels != -100).sum()
    args = (hidden, labels, divisor, [head.weight], module_key(head), 48, softcap, -100, vocab, sliced, True, "")
    if not sliced:
        # opcheck runs the kernel on copies of the inputs: where its forward takes the head's gradients it refuses a
        # weight that is not the head's own (mst_core/wrappers.py `check_graph_inputs`), as the backward kernels do.
        # The fake implementation checked by hand; the compiled steps above check this path's autograd formula.
        from torch._subclasses.fake_tensor import FakeTensorMode

        real = compiled.mini_sequence_loss(*args)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
            fake_args[3] = [mode.from_tensor(p) for p in args[3]]
            fake = compiled.mini_sequence_loss(*fake_args)
        assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in real], (fake, real)
        assert len(real) == 3 and real[2].dtype == torch.float32  # [loss, hidden's gradient, the weight's]
    else:
        torch.library.opcheck(compiled.mini_sequence_loss, args,
                              test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
        out = compiled.mini_sequence_loss(*args)
        grad_args = (torch.ones(()), hidden.detach(), labels, out[1], divisor, [head.weight], module_key(head), 48,
                     softcap, -100, True, "")
        torch.library.opcheck(compiled.mini_sequence_loss_backward, grad_args,
                              test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("family,fields,checkpointing", [
    ("llama", dict(mini_sequence_chunk=48), True),
    ("gemma3_text", dict(mini_sequence_chunk=48, streaming_backward_chunk=48), False),
    ("qwen3_moe", dict(mini_sequence_chunk=48, streaming_backward_chunk=48), False),
    ("falcon_h1", dict(mini_sequence_chunk=48, streaming_backward_chunk=48), False),
    ("llama", dict(streaming_backward_chunk=48), False),
], ids=["llama-mini_sequence+checkpointing", "gemma3_text-both", "qwen3_moe-both", "falcon_h1-both", "llama-streaming"])
def test_trainer_torch_compile_trains_as_eager_unset(tmp_path, family, fields, checkpointing):
    """`TrainingArguments(torch_compile=True)` as users run it, with gradient accumulation and padded rows: no graph
    break, one compiled graph, and the logged losses and the weights' updates equal the eager Trainer's with the fields
    unset (SGD: Adam's first updates would turn fp32 rounding into lr-sized steps)."""
    import transformers
    from torch._dynamo.utils import counters

    def rows():
        generator = torch.Generator().manual_seed(3)
        return [{"input_ids": torch.randint(1, 128, (int(n),), generator=generator)}
                for n in torch.randint(120, 200, (8,), generator=generator)]

    def collate(batch):  # right-padded to one width: one compiled graph
        ids = torch.zeros(len(batch), 200, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, row in enumerate(batch):
            ids[i, : len(row["input_ids"])] = row["input_ids"]
            mask[i, : len(row["input_ids"])] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

    def train(compiled, **model_fields):
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / str(compiled)), per_device_train_batch_size=2, gradient_accumulation_steps=2,
            max_steps=2, learning_rate=0.1, optim="sgd", logging_steps=1, report_to=[], seed=0, save_strategy="no",
            use_cpu=True, dataloader_num_workers=0, torch_compile=compiled, gradient_checkpointing=checkpointing,
        )
        model = make_model(family, seed=1, attn_implementation="sdpa", use_cache=False, **model_fields)
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        torch._dynamo.reset()
        counters.clear()
        trainer = transformers.Trainer(model=model, args=args, train_dataset=rows(), data_collator=collate)
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        updates = {name: p.detach() - before[name] for name, p in model.named_parameters()}
        assert counters["stats"]["unique_graphs"] == int(compiled), dict(counters["stats"])
        return losses, updates, dict(counters["graph_break"])

    ref_losses, ref_updates, _ = train(False)
    losses, updates, breaks = train(True, **fields)
    assert not breaks, breaks
    assert len(losses) == 2 and losses == pytest.approx(ref_losses, rel=1e-5), (losses, ref_losses)
    # Every weight trained, but those whose SGD step here is below their fp32 spacing (Falcon-H1's Mamba `D`, ones at
    # init, and `dt_bias`: their gradients are under 1e-6 in this tiny model); ours leaves the same ones unmoved.
    unmoved = sorted(name for name, update in ref_updates.items() if update.abs().max() == 0)
    assert all(name.endswith(("mamba.D", "mamba.dt_bias")) for name in unmoved), unmoved
    assert unmoved == sorted(name for name, update in updates.items() if update.abs().max() == 0)
    worst = max(updates, key=lambda name: rel_err(updates[name], ref_updates[name]))
    # 1e-4: compiling alone, fields unset, moves the Llama case's q_proj update by 4.6e-5 (fields set: the same)
    assert rel_err(updates[worst], ref_updates[worst]) < 1e-4, (worst, rel_err(updates[worst], ref_updates[worst]))


def _host_mask_calls(monkeypatch):
    """How many times the host-mask attention operator's forward kernel ran (mst_core/host_mask.py `_call`)."""
    from transformers.mst_core import host_mask

    calls, call = [0], host_mask._call

    def counted(*args, **kwargs):
        calls[0] += 1
        return call(*args, **kwargs)

    monkeypatch.setattr(host_mask, "_call", counted)
    return calls


def packed_batch(seed=0):
    """Two rows of packed sequences (position ids restarting at 0: 70 + 130 tokens, 120 + 80), no attention mask;
    each sequence's first label ignored, as a packing collator does."""
    ids, _, labels = batch(seed)
    positions = torch.stack([torch.cat([torch.arange(70), torch.arange(130)]),
                             torch.cat([torch.arange(120), torch.arange(80)])])
    labels = labels.clone()
    labels[positions == 0] = -100
    return ids, positions, labels


def packed_loss_of(model, ids, positions, labels):
    return model(input_ids=ids, position_ids=positions, labels=labels).loss


@pytest.mark.parametrize("fields,checkpointing,kernel_calls", [
    # 2 layers x (forward, the checkpointed layer's recompute): the backward kernel recomputes nothing
    (dict(mini_sequence_chunk=48), True, 2 * 2),
    (dict(mini_sequence_chunk=48), False, 2),
    (dict(streaming_backward_chunk=48), False, 0),  # the streamed layers' operator builds it in its own kernels
    (dict(mini_sequence_chunk=48, streaming_backward_chunk=48), False, 0),
])
@pytest.mark.parametrize("inputs", ["packed", "padded"])
def test_compiled_step_decides_the_mask_on_the_host(monkeypatch, fields, checkpointing, kernel_calls, inputs):
    """Under torch.compile with a field set, the causal mask is decided on the host as the eager step decides it
    (mst_core/host_mask.py): packed sequences (position ids restarting, no attention mask) and left padding, exact
    against the eager unsplit step, `fullgraph=True`; the attention ran through the host-mask operator where no
    streamed layer took the call, and no graph it kept outlives the step (a checkpointed layer's first forward
    leaves one the backward never takes). Fails if the operator's mask differs from the eager one (a packed row
    attending across its sequences, a padded key read)."""
    from transformers.mst_core import host_mask

    step, data = (packed_loss_of, packed_batch()) if inputs == "packed" else (loss_of, batch())

    def train(compiled, **fields):
        model = make_model("llama", seed=1, use_cache=False, attn_implementation="sdpa", **fields).train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        torch._dynamo.reset()
        loss = (torch.compile(step, fullgraph=True) if compiled else step)(model, *data)
        loss.backward()
        return loss.detach(), {name: p.grad for name, p in model.named_parameters()}

    ref = train(False)
    calls = _host_mask_calls(monkeypatch)
    assert_same_step(train(True, **fields), ref)
    assert calls[0] == kernel_calls, calls
    assert not host_mask._PENDING


def test_compiled_step_without_fields_builds_the_mask_as_upstream():
    """With every field unset, a traced mask function is upstream's: under torch.compile it returns the mask tensor
    (torch < 2.14 cannot skip it while tracing), never a `HostMask`."""
    from transformers import masking_utils
    from transformers.mst_core.host_mask import HostMask

    results = {}
    for name, fields in (("unset", {}), ("set", dict(mini_sequence_chunk=48))):
        config = make_model("llama", attn_implementation="sdpa", **fields).config

        def create(embeds, positions):
            results[name] = masking_utils.create_causal_mask(
                config=config, inputs_embeds=embeds, attention_mask=None, cache=None, position_ids=positions
            )
            return embeds.sum()

        torch._dynamo.reset()
        torch.compile(create, fullgraph=True)(torch.randn(1, 16, 4), torch.arange(16)[None])
    assert isinstance(results["set"], HostMask)
    assert isinstance(results["unset"], torch.Tensor) and results["unset"].shape == (1, 1, 16, 16)


def test_host_mask_keeps_the_eager_memory(monkeypatch):
    """The point of deciding on the host: built in the graph, the [S, S] mask lives through the compiled step (and
    SDPA's CPU kernel takes it as a float mask); decided on the host, the causal kernel needs none. One narrow layer,
    2048 tokens, `mini_sequence+checkpointing`: the step must peak lower than the same step with the mask built in the
    graph by at least the [2048, 2048] bool mask."""
    from transformers.mst_core import host_mask

    ids = torch.randint(1, 128, (1, 2048), generator=torch.Generator().manual_seed(0))

    def peak(**patches):
        for name, value in patches.items():
            monkeypatch.setattr(host_mask, name, value)
        model = make_model("llama", seed=1, attn_implementation="sdpa", use_cache=False, num_hidden_layers=1,
                           mini_sequence_chunk=256).train()
        model.gradient_checkpointing_enable()
        result = _compiled_step_peak(model, ids)
        monkeypatch.undo()
        return result

    decided_on_host = peak()
    built_in_graph = peak(_field_set=lambda config: False)
    assert decided_on_host < built_in_graph - 2048 * 2048, (decided_on_host, built_in_graph)


def test_host_mask_operators_pass_opcheck():
    """torch.library.opcheck on the host-mask attention operator (schema, fake tensor, autograd registration) as the
    compiled graph calls it: a registered attention module, a left-padded mask and one without padding."""
    from transformers.mst_core import host_mask
    from transformers.mst_core.custom_ops import module_key

    model = make_model("llama", seed=1, mini_sequence_chunk=48).train()
    attention = model.model.layers[0].self_attn
    heads, kv_heads, width = attention.config.num_attention_heads, attention.config.num_key_value_heads, attention.head_dim
    for padding in (0, 7):
        mask = torch.ones(2, 50, dtype=torch.bool)
        mask[1, :padding] = False
        deferred = host_mask.HostMask("create_causal_mask", mask, None)
        text = repr((deferred.text(), [], attention.scaling, None, [], "", "float32"))
        args = (torch.randn(2, heads, 50, width, requires_grad=True), torch.randn(2, kv_heads, 50, width, requires_grad=True),
                torch.randn(2, kv_heads, 50, width, requires_grad=True), deferred.tensors(), module_key(attention), text)
        torch.library.opcheck(host_mask.host_mask_sdpa, args,
                              test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


@pytest.mark.parametrize("name", ["create_causal_mask", "create_sliding_window_causal_mask", "create_chunked_causal_mask"])
def test_host_mask_wrapper_takes_upstreams_parameters(name):
    """`decided_on_host` spells out the parameters of the mask functions it wraps (dynamo traces it; binding a
    signature would not trace): they must be upstream's, in upstream's order, with upstream's defaults, or a rebase
    that adds one would pass it to the wrong parameter."""
    import inspect

    from transformers import masking_utils
    from transformers.mst_core.host_mask import _UPSTREAM

    wrapper = getattr(masking_utils, name).__wrapped__  # under upstream's `deprecate_kwarg`
    assert wrapper.__wrapped__ is _UPSTREAM[name]
    ours = inspect.signature(wrapper, follow_wrapped=False).parameters.values()
    upstream = inspect.signature(_UPSTREAM[name]).parameters.values()
    assert [(p.name, p.default) for p in ours] == [(p.name, p.default) for p in upstream]


def test_host_mask_attention_refuses_a_second_backward():
    """The operator's backward takes the graph its forward kept, once: a second backward through the same call says
    so instead of backpropagating something else."""
    from transformers.mst_core import host_mask
    from transformers.mst_core.custom_ops import module_key

    model = make_model("llama", seed=1, mini_sequence_chunk=48).train()
    attention = model.model.layers[0].self_attn
    heads, width = attention.config.num_attention_heads, attention.head_dim
    query, key, value = (torch.randn(1, heads, 20, width, requires_grad=True) for _ in range(3))
    text = repr((host_mask.HostMask("create_causal_mask", None, None).text(), [], attention.scaling, None, [], "", "float32"))
    out, _ = host_mask.host_mask_sdpa(query, key, value, [], module_key(attention), text)
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="already backpropagated"):
        out.sum().backward()


def _choices(ours):
    """(inductor's choices handler for this thread, the config value that keys its caches): ours or inductor's own."""
    from torch._inductor.choices import InductorChoices

    from transformers.mst_core.recompute_fusion import recompute_choices

    return (recompute_choices(), recompute_choices) if ours else (InductorChoices(), None)


def _compiled_with(ours, run):
    """`run()` compiled under our inductor choices or inductor's own (the thread's handler and the config, which keys
    inductor's caches), then ours again, as a model with a field installs them. (Not pytest's monkeypatch: its undo
    deletes a key from torch's config module.)"""
    import torch._inductor.config as inductor_config
    from torch._inductor.virtualized import V

    handler, factory = _choices(ours)
    inductor_config.inductor_choices_class = factory
    V.set_choices_handler(handler)
    try:
        return run()
    finally:
        handler, factory = _choices(True)
        inductor_config.inductor_choices_class = factory
        V.set_choices_handler(handler)


def test_compiled_checkpointed_step_recomputes_each_layer_in_its_turn():
    """Inductor fused a checkpointed layer's recomputed rotary embedding with the next layer's rotary backward (shared
    cos/sin reads), so the whole recompute ran before that layer's weight-gradient products and their inputs stayed
    live (mst_core/recompute_fusion.py). Three narrow layers, 1024 tokens, `mini_sequence+checkpointing`: with our
    choices the compiled step peaks within 5% of the eager one and below inductor's own choices by at least two
    [1024, 128] fp32 tensors (measured: 11.77 against 13.27 MiB, eager 11.61)."""
    ids = torch.randint(1, 128, (1, 1024), generator=torch.Generator().manual_seed(0))
    model = make_model("llama", seed=1, attn_implementation="sdpa", use_cache=False, num_hidden_layers=3, hidden_size=128,
                       intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, mini_sequence_chunk=256).train()
    model.gradient_checkpointing_enable()
    ours = _compiled_with(True, lambda: _compiled_step_peak(model, ids))
    inductors = _compiled_with(False, lambda: _compiled_step_peak(model, ids))
    eager = _eager_step_peak(model, ids)
    assert ours < inductors - 2 * 1024 * 128 * 4, (ours, inductors)
    assert ours <= 1.05 * eager, (ours, eager)


def _eager_step_peak(model, ids):
    from transformers.mst_core.memory import LiveTensorTracker

    loss_of(model, ids, None, ids).backward()
    model.zero_grad(set_to_none=True)
    with LiveTensorTracker() as tracker:
        loss_of(model, ids, None, ids).backward()
    model.zero_grad(set_to_none=True)
    return tracker.peak_bytes


def test_recompute_choices_leave_graphs_without_our_operators():
    """A model with our fields unset compiles to the same code under our choices as under inductor's own (the rule
    applies only to backward graphs holding our operators)."""
    from torch._inductor.utils import run_and_get_code

    ids = torch.randint(1, 128, (1, 256), generator=torch.Generator().manual_seed(0))
    model = make_model("llama", seed=1, attn_implementation="sdpa", use_cache=False, num_hidden_layers=2).train()
    model.gradient_checkpointing_enable()

    def code():
        torch._dynamo.reset()
        step = torch.compile(loss_of, fullgraph=True)
        _, sources = run_and_get_code(lambda: step(model, ids, None, ids).backward())
        model.zero_grad(set_to_none=True)
        # Past the first line ("# AOT ID: ['<n>_forward']"), with the symbols of dynamic sizes, numbered per compile.
        return [re.sub(r"\bs\d+\b", "s", source.partition("\n")[2]) for source in sources]

    ours, inductors = _compiled_with(True, code), _compiled_with(False, code)
    assert len(ours) == 2 and ours == inductors  # a forward and a backward graph


def test_recompute_choices_installed_with_a_field_and_never_over_the_users(caplog):
    import logging

    import torch._inductor.config as inductor_config

    from transformers.mst_core.recompute_fusion import recompute_choices

    def users_choices():
        return None

    before = inductor_config.inductor_choices_class
    try:
        inductor_config.inductor_choices_class = None
        make_model("llama", seed=1)
        assert inductor_config.inductor_choices_class is None  # no field: upstream's compiler settings
        make_model("llama", seed=1, streaming_backward_chunk=48)
        assert inductor_config.inductor_choices_class is recompute_choices
        inductor_config.inductor_choices_class = users_choices
        with caplog.at_level(logging.WARNING):
            make_model("llama", seed=1, mini_sequence_chunk=48)
        assert inductor_config.inductor_choices_class is users_choices
        assert "inductor_choices_class is set" in caplog.text and "users_choices" in caplog.text
    finally:
        inductor_config.inductor_choices_class = before


def test_host_mask_called_eagerly_builds_the_mask_on_the_host(monkeypatch):
    """A `HostMask` that reaches the attention outside a compiled graph (after a graph break) is built on the host and
    upstream's call runs as eagerly, with no operator and no traced first-query probe: the output equals upstream's
    with the mask its function builds."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.mst_core import host_mask

    calls = _host_mask_calls(monkeypatch)
    probes = []
    monkeypatch.setattr(host_mask, "host_mask_sdpa", lambda *args: probes.append(args))
    model = make_model("llama", seed=1, mini_sequence_chunk=48).train()
    attention = model.model.layers[0].self_attn
    heads, kv_heads, width = attention.config.num_attention_heads, attention.config.num_key_value_heads, attention.head_dim
    query = torch.randn(2, heads, 20, width)
    key, value = (torch.randn(2, kv_heads, 20, width) for _ in range(2))
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[1, :6] = False
    deferred = host_mask.HostMask("create_causal_mask", mask, None)
    got, _ = host_mask.host_mask_attention(attention, query, key, value, deferred, scaling=attention.scaling)
    built = deferred.built(attention.config, query.transpose(1, 2))
    assert built is not None
    ref, _ = sdpa_attention_forward(attention, query, key, value, built, scaling=attention.scaling)
    assert calls[0] == 0 and not probes
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


@pytest.mark.parametrize("padding", [0, 7])
def test_streamed_layer_operator_passes_opcheck(padding):
    """torch.library.opcheck on the streamed layer's operator (schema, fake tensor, autograd registration) as the
    compiled graph calls it: a registered Llama layer, its rotary embedding and position ids, the mask decided on the
    host (left padding or none), 50 rows in chunks of 16."""
    from transformers.mst_core.custom_ops import module_key
    from transformers.mst_core.host_mask import HostMask
    from transformers.streaming_backward import compiled

    model = make_model("llama", seed=1, streaming_backward_chunk=16).train()
    layer = model.model.layers[0]
    hidden = torch.randn(2, 50, model.config.hidden_size, requires_grad=True)
    positions = torch.arange(50).expand(2, -1)
    mask = torch.ones(2, 50, dtype=torch.bool)
    mask[1, :padding] = False
    kwargs = {"attention_mask": HostMask("create_causal_mask", mask, None), "position_ids": positions,
              "position_embeddings": model.model.rotary_emb(hidden, positions)}
    tensors, text = compiled._encode(kwargs, "cpu")
    params = [p for p in layer.parameters() if p.requires_grad]
    torch.library.opcheck(compiled.streamed_layer, (hidden, tensors, params, module_key(layer), text),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))

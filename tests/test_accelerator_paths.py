"""What runs differently on an accelerator, run on this CPU: the LM-head loss's compiled kernels
(mini_sequence/fused_loss.py, inductor's C++ kernels here, Triton on CUDA) and the "auto" MLP chunk policy of a
device that is not the CPU (mini_sequence/config.py)."""

import pytest
import torch
from torch._dynamo.utils import counters

import transformers
from transformers.mini_sequence import config as ms_config
from transformers.mini_sequence import fused_loss, loss
from transformers.mst_core.chunks import chunk_policy_for


@pytest.fixture
def fused_on_cpu(monkeypatch):
    """The fused kernels on this CPU, and a count of the compiled calls (so that no test compares eager with eager)."""
    monkeypatch.setattr(fused_loss, "DEVICES", {"cpu"})
    monkeypatch.setattr(fused_loss, "_failed", [])
    monkeypatch.delenv(fused_loss.ENV_VAR, raising=False)
    calls = []
    run = fused_loss._run

    def counted(body, *args):
        calls.append(body.__name__)
        return run(body, *args)

    monkeypatch.setattr(fused_loss, "_run", counted)
    return calls


def _loss_and_grads(dtype, sliced, softcap, hooked=False, tokens=300, vocab=1000, hidden=64, chunk=128):
    """Loss, hidden-state gradient and head-weight gradient of `mini_sequence_causal_lm_loss` on fresh inputs (the
    same ones for every call with the same sizes): uneven chunks, ignored labels. `sliced` picks the head's
    backward (loss.py: vocabulary slices, or the accumulating one); `hooked`: a forward hook on the head, the
    wrapper path (`_CrossEntropySum` in checkpointed chunks)."""
    generator = torch.Generator().manual_seed(tokens + vocab)
    hidden_states = torch.randn(1, tokens, hidden, generator=generator, dtype=torch.float64)
    weight = torch.randn(vocab, hidden, generator=generator, dtype=torch.float64) * 0.3
    labels = torch.randint(0, vocab, (1, tokens), generator=generator)
    labels[0, ::7] = -100
    head = torch.nn.Linear(hidden, vocab, bias=False, dtype=dtype)
    with torch.no_grad():
        head.weight.copy_(weight)
    if hooked:
        head.register_forward_hook(lambda module, args, out: None)
    h = hidden_states.to(dtype).requires_grad_()
    pays = loss._vocab_sliced_backward_pays
    loss._vocab_sliced_backward_pays = lambda *args: sliced and pays(*args)
    try:
        value = loss.mini_sequence_causal_lm_loss(h, head, labels, chunk_size=chunk, vocab_size=vocab,
                                                  final_logit_softcapping=softcap)
        value.backward()
    finally:
        loss._vocab_sliced_backward_pays = pays
    return [value.detach().double(), h.grad.double(), head.weight.grad.double()]


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


CASES = [  # dtype, sliced head, soft-cap, hooked head
    (torch.bfloat16, False, None, False),
    (torch.bfloat16, True, None, False),
    (torch.bfloat16, False, 30.0, False),
    (torch.bfloat16, True, 30.0, False),
    (torch.float32, False, 30.0, False),  # a plain fp32 head goes to torch's fused op: soft-capped, it comes here
    (torch.bfloat16, False, None, True),
]


@pytest.mark.parametrize("dtype,sliced,softcap,hooked", CASES)
def test_fused_kernels_give_the_eager_blocks_results(fused_on_cpu, dtype, sliced, softcap, hooked):
    """Loss and gradients of the compiled kernels against the eager row blocks (the same arithmetic: they differ
    where the compiled exp / log round differently in fp32, a few half-precision gradients by one unit in the last
    place), and both against fp64 by the same error."""
    fused = _loss_and_grads(dtype, sliced, softcap, hooked)
    assert fused_on_cpu, "the fused kernels did not run"
    fused_loss.DEVICES.clear()
    eager = _loss_and_grads(dtype, sliced, softcap, hooked)
    exact = _loss_and_grads(torch.float64, sliced, softcap, hooked)
    for name, f, e, x in zip(("loss", "hidden grad", "weight grad"), fused, eager, exact):
        assert _rel(f, e) <= (1e-6 if dtype == torch.float32 else 1e-4), (name, _rel(f, e))
        assert _rel(f, x) <= 1.05 * _rel(e, x) + 1e-7, (name, _rel(f, x), _rel(e, x))


def test_fused_kernels_compile_once_for_every_shape(fused_on_cpu):
    """One compiled graph per kernel for every chunk, slice and vocabulary size (dynamic shapes): no recompile on a
    user's last, shorter chunk or at the next length."""
    _loss_and_grads(torch.bfloat16, True, None, tokens=300, vocab=1000)
    graphs = counters["stats"]["unique_graphs"]
    _loss_and_grads(torch.bfloat16, True, None, tokens=517, vocab=1500, chunk=200)
    _loss_and_grads(torch.bfloat16, True, None, tokens=90, vocab=700, chunk=64)
    assert counters["stats"]["unique_graphs"] == graphs, "a new shape compiled a new graph"
    assert set(fused_on_cpu) == {"_log_prob_at_target", "_sliced_grad_"}


def test_a_kernel_that_fails_to_compile_falls_back_to_the_eager_blocks(fused_on_cpu, monkeypatch):
    def broken(body):
        def compiled(*args):
            raise RuntimeError("no C++ compiler found")
        return compiled

    monkeypatch.setattr(fused_loss, "_compiled", broken)
    got = _loss_and_grads(torch.bfloat16, False, None)
    assert fused_on_cpu and len(fused_loss._failed) == 1 and not fused_loss.applies(torch.zeros(2, 2))
    fused_loss.DEVICES.clear()
    want = _loss_and_grads(torch.bfloat16, False, None)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_the_environment_variable(monkeypatch, fused_on_cpu):
    logits = torch.zeros(2, 3)
    assert fused_loss.applies(logits)
    monkeypatch.setenv(fused_loss.ENV_VAR, "0")
    assert not fused_loss.applies(logits)
    monkeypatch.setenv(fused_loss.ENV_VAR, "yes")
    with pytest.raises(ValueError, match=f"{fused_loss.ENV_VAR}='yes': allowed 1 .* or 0"):
        fused_loss.applies(logits)


def test_fused_kernels_only_on_cuda_by_default(monkeypatch):
    monkeypatch.delenv(fused_loss.ENV_VAR, raising=False)
    assert fused_loss.DEVICES == {"cuda"} and not fused_loss.applies(torch.zeros(2, 3))


def test_accelerator_mlp_chunks():
    """ "auto" MLP mini-sequences: hidden_size tokens on the CPU, at least AUTO_MIN_MLP_TOKENS_ACCELERATOR elsewhere;
    an int is the user's. `chunk_policy_for` (the planner) applies a device's policy to CPU tensors."""
    floor = ms_config.AUTO_MIN_MLP_TOKENS_ACCELERATOR
    assert ms_config.mlp_chunk_size("auto", 64) == ms_config.mlp_chunk_size("auto", 64, "cpu") == 64
    assert ms_config.mlp_chunk_size("auto", 64, "cuda") == floor
    assert ms_config.mlp_chunk_size("auto", 2 * floor, "cuda") == 2 * floor
    assert ms_config.mlp_chunk_size(100, 64, "cuda") == 100

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, mini_sequence_chunk="auto"))
    rows = []
    model.model.layers[0].mlp.gate_proj.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[1]))
    ids = torch.zeros(1, floor + 10, dtype=torch.long)
    with torch.no_grad():
        model(input_ids=ids[:, :100])
        assert rows == [32, 32, 32, 4]
        rows.clear()
        with chunk_policy_for("cuda"):
            model(input_ids=ids[:, :100])
            assert rows == [100]
            rows.clear()
            model(input_ids=ids)
            assert rows == [floor, 10]
        rows.clear()
        model(input_ids=ids[:, :100])
        assert rows == [32, 32, 32, 4]  # the policy's device is the tensors' again


def test_streamed_chunks_follow_the_policy_device(monkeypatch):
    """The streamed layer asks for the chunk size of its hidden states' device, or `chunk_policy_for`'s; on an
    accelerator "auto" is at least MIN_AUTO_CHUNK_ACCELERATOR query tokens."""
    from transformers.streaming_backward import config as streaming_config
    from transformers.streaming_backward import layer

    assert streaming_config.streaming_chunk_size("auto", 32, "cuda") == streaming_config.MIN_AUTO_CHUNK_ACCELERATOR
    asked = []

    def spy(value, hidden_size, device_type="cpu"):
        asked.append(device_type)
        return streaming_config.streaming_chunk_size(value, hidden_size, device_type)

    monkeypatch.setattr(layer, "streaming_chunk_size", spy)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, streaming_backward_chunk="auto", use_cache=False)).train()
    ids = torch.randint(0, 100, (1, 40), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    with chunk_policy_for("cuda"):
        model(input_ids=ids, labels=ids).loss.backward()
    assert asked == ["cpu", "cuda"]


def test_fused_kernels_in_a_training_step(fused_on_cpu):
    """A bf16 Llama step with `mini_sequence_chunk` set (padding, ignored labels, batch 2): with the compiled kernels
    every gradient is as close to the fp64 step's as with the eager blocks."""
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, mini_sequence_chunk=24,
                                      pad_token_id=0)
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(config).double().train()
    ids = torch.randint(1, 300, (2, 70), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, 30:40] = -100

    def step(dtype):
        model = transformers.LlamaForCausalLM(config).to(dtype).train()
        model.load_state_dict(reference.state_dict())
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        return {name: p.grad.double() for name, p in model.named_parameters()}

    fused = step(torch.bfloat16)
    assert "_loss_grad_" in fused_on_cpu or "_sliced_grad_" in fused_on_cpu, fused_on_cpu
    fused_loss.DEVICES.clear()
    eager, exact = step(torch.bfloat16), step(torch.float64)
    for name, want in exact.items():
        assert _rel(fused[name], want) <= 1.1 * _rel(eager[name], want) + 1e-6, (name, _rel(fused[name], want),
                                                                                   _rel(eager[name], want))

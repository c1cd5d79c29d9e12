"""Host work per training step (scripts/host_cost.py, `bench.py host`): operator counts are exact on any machine, so
a method's count relative to checkpointing's is held to a budget here (a count, not a time), and so is the number of
passes through the projections under a wrapper's hooks."""

import re

import host_cost
import pytest
import torch
from conftest import REPO, run_py

from transformers import LlamaConfig, LlamaForCausalLM

# Aten operators per step relative to checkpointing's, scripts/host_cost.py's setup (16 layers; per `policy`, the
# chunk counts "auto" gives Llama-3.2-1B at 16K on that device type: 8 MLP and 8 streamed chunks on the CPU, 4 and 4
# on an accelerator), torch 2.13.0. Measured at 5.24.0+mst.28 (mini_sequence+checkpointing without hooks at mst.45: its
# MLP chunks on a batch of one sequence run on the tokens' rows; the accelerator's counts at mst.45): see
# docs/measurements.md, "Host work per step". A change that adds operators per chunk fails here; one that removes some
# should lower its budget.
OPERATOR_BUDGET = {
    ("cpu", False, "mini_sequence+checkpointing"): 2.03,
    ("cpu", False, "streaming"): 9.89,
    ("cpu", False, "mini_sequence+streaming"): 9.95,
    ("cpu", True, "mini_sequence+checkpointing"): 3.05,
    ("cpu", True, "streaming"): 12.48,
    ("cpu", True, "mini_sequence+streaming"): 12.86,
    ("cuda", False, "mini_sequence+checkpointing"): 1.43,
    ("cuda", False, "streaming"): 4.92,
    ("cuda", False, "mini_sequence+streaming"): 4.95,
}


@pytest.mark.parametrize("policy, hooks", [("cpu", False), ("cpu", True), ("cuda", False)],
                         ids=["plain", "hooks", "accelerator_chunks"])
def test_operators_per_step_within_budget(policy, hooks):
    reference = host_cost.counted_step("checkpointing", hooks, policy=policy)[0].total
    for method in ("mini_sequence+checkpointing", "streaming", "mini_sequence+streaming"):
        count = host_cost.counted_step(method, hooks, policy=policy)[0]
        ratio = count.total / reference
        assert ratio <= OPERATOR_BUDGET[policy, hooks, method], (method, count.total, reference,
                                                                 count.by_name.most_common(12))


SMALL = dict(num_hidden_layers=2)


@pytest.mark.parametrize("method", list(host_cost.METHODS))
@pytest.mark.parametrize("hooks", [False, True], ids=["plain", "hooks"])
def test_each_projection_sees_each_token_twice(method, hooks):
    """As under checkpointing: the forward and one recompute, with or without a wrapper's hooks on every module. Under
    hooks the chunks run under nested checkpoints: read as checkpoint inputs, the layer's recompute ran 7 of 8 chunks
    again (2.875 passes through the MLP), and the streamed layer's K/V passes ran the query projection (4.875)."""
    _, queries, gates = host_cost.counted_step(method, hooks, seq_len=256, shape=SMALL)
    assert (queries, gates) == (2.0, 2.0)


def _grads(model, ids, mask, labels):
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("fields", [dict(mini_sequence_chunk=7), dict(streaming_backward_chunk=9),
                                    dict(mini_sequence_chunk=7, streaming_backward_chunk=9)],
                         ids=["mini_sequence", "streaming", "both"])
def test_chunks_read_from_saved_inputs_under_hooks_are_exact(fields):
    """The checkpointed chunks of the hooks path (mst_core/wrappers.py `ChunkSource`, streaming_backward/layer.py
    `_forward_with_checkpoints`): loss and every gradient as flags unset, under the layer's checkpointing, with left
    padding, ignored labels, a frozen embedding (the first layer's input needs no gradient) and two backwards."""
    config = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=64, attn_implementation="sdpa", use_cache=False)
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 64, (2, 40), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, 10:15] = -100
    results = []
    for flags in ({}, fields):
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**config, **flags)).train()
        model.gradient_checkpointing_enable()
        model.model.embed_tokens.weight.requires_grad_(False)
        for module in model.modules():
            module.register_forward_pre_hook(lambda module, args: None)
        first = _grads(model, ids, mask, labels)
        results.append((first, _grads(model, ids, mask, labels)))  # accumulated: twice the first
    for (loss, grads), (loss_ref, grads_ref) in zip(results[1], results[0]):
        assert torch.allclose(loss, loss_ref, rtol=1e-6, atol=0)
        assert grads.keys() == grads_ref.keys()
        for name, grad in grads.items():
            scale = grads_ref[name].abs().max().item()
            assert (grad - grads_ref[name]).abs().max().item() <= 1e-5 * scale, name


def test_compiled_chunk_probe_launches_less_and_compiles_once():
    """scripts/streamed_compile_probe.py, the measurement docs/measurements.md reports for compiled chunk bodies of the
    streamed layer: it still runs on this build (it patches the streamed layer's classes), its compiled chunks launch
    fewer kernels than the same changes eager, and dynamo makes no graph during the timed steps."""
    result = run_py([str(REPO / "scripts" / "streamed_compile_probe.py"), "--layers", "2", "--seq", "64",
                     "--repeats", "2"], env_extra={"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert re.search(r"graphs: [1-9]\d* \(0 more during the timed steps\)", result.stdout), result.stdout
    launches = {line.split(" | ")[0].lstrip("| "): int(line.split(" | ")[1])
                for line in result.stdout.splitlines() if line.startswith("| ") and not line.startswith("| case")}
    assert launches["streaming, probe's changes, compiled"] < launches["streaming, probe's changes, eager"], launches

"""ZeRO-3 leaf modules (MoE blocks) in a streamed layer: DeepSpeed's per-call reduction hook queues them once.

One-process stand-in for DeepSpeed ZeRO-3 (the real run: tests/test_distributed.py, zero3 and zero3_offload):
parameters marked with `ds_id` (the streamed layer takes the nested-checkpoint fallback), MoE blocks flagged as leaf
modules (`_z3_leaf`, DeepSpeed's default for Mixtral and Qwen3-MoE), and on each of them a full backward hook
registered before the first forward, as DeepSpeed's `reduce_leaf_module_grads` is, recording at each firing which
weights DeepSpeed would queue for reduction (`ds_grad_is_ready`, unset: True) and their gradients then.
"""

import pytest
import torch
from tiny_models import make_model

SEQ, STREAM = 23, 5


def fake_zero3(model):
    for param in model.parameters():
        param.ds_id = 0
    firings = {}
    for layer in model.model.layers:
        block = layer.mlp
        block._z3_leaf = True
        firings[block] = []

        def reduce_leaf_module_grads(module, grad_input, grad_output, record=firings[block]):
            queued = {name: p.grad.clone() if p.grad is not None else None
                      for name, p in module.named_parameters() if getattr(p, "ds_grad_is_ready", True)}
            record.append(queued)

        block.register_full_backward_hook(reduce_leaf_module_grads)
    return firings


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_streamed_moe_block_queued_once_with_its_whole_gradient(family):
    off = make_model(family, seed=0, use_cache=False).train()
    on = make_model(family, seed=0, use_cache=False, streaming_backward_chunk=STREAM).train()
    ids = torch.randint(1, 128, (2, SEQ), generator=torch.Generator().manual_seed(0))
    off(input_ids=ids, labels=ids).loss.backward()
    firings = fake_zero3(on)
    for step in range(2):  # a second step: the counts start over
        on.zero_grad(set_to_none=True)
        for record in firings.values():
            record.clear()
        on(input_ids=ids, labels=ids).loss.backward()
        chunks = -(-SEQ // STREAM)
        for block, record in firings.items():
            assert len(record) == chunks, (step, len(record))  # one firing per query chunk
            assert all(not queued for queued in record[:-1]), step  # none queued before the last firing
            assert set(record[-1]) == {name for name, _ in block.named_parameters()}
            for name, param in block.named_parameters():
                assert torch.equal(record[-1][name], param.grad), (step, name)  # complete when queued
    off_grads = dict(off.named_parameters())
    for name, param in on.named_parameters():
        torch.testing.assert_close(param.grad, off_grads[name].grad, rtol=1e-5, atol=1e-6)

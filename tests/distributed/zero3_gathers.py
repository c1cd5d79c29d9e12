"""Per-rank script (torchrun, 2 processes, gloo): how often DeepSpeed ZeRO-3 gathers weights.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 tests/distributed/zero3_gathers.py CHUNK [STREAM]

ZeRO-3 with every weight partitioned, no persistence, no prefetch; counts the gathers of each weight
shape per step. Rank 0 prints one JSON line per step: loss, lm_head gradient norm, gathers. CHUNK:
`mini_sequence_chunk`, "none" (unset) or an int; STREAM: `streaming_backward_chunk`, the same (default
none). One setting per launch (a second `zero.Init` in one process fails). FSDP's gathers are counted
in fsdp_run.py.
"""

import json
import os
import sys
from collections import Counter

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import transformers  # noqa: E402
from tiny_models import make_config  # noqa: E402
from leave import leave_process_group  # noqa: E402

# The tiny Llama, with sizes that make the LM head's weight shape (1000x64) unique.
SIZES = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, use_cache=False,
             pad_token_id=None)  # a padding_idx row cannot be zeroed inside zero.Init (partitioned weight)
SEQ, STEPS = 64, 2


def zero3_run(chunk, stream):
    import deepspeed
    import deepspeed.runtime.zero.partitioned_param_coordinator as coordinator
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    counts = Counter()
    cls = coordinator.PartitionedParameterCoordinator
    name = "_PartitionedParameterCoordinator__all_gather_params"
    all_gather = getattr(cls, name)

    def counting_all_gather(self, params, *args, **kwargs):
        for p in params:
            if p.ds_status == ZeroParamStatus.NOT_AVAILABLE:
                counts["x".join(map(str, p.ds_shape))] += 1
        return all_gather(self, params, *args, **kwargs)

    setattr(cls, name, counting_all_gather)
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_allow_untested_optimizer": True,
    }
    # Import the model's module (and torch._dynamo, which it imports) before zero.Init patches
    # torch.Tensor.__new__: importing dynamo inside it fails (torch 2.13, deepspeed 0.19.8).
    model_class = transformers.LlamaForCausalLM
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = model_class(make_config("llama", **SIZES, mini_sequence_chunk=chunk,
                                        streaming_backward_chunk=stream))
    engine, *_ = deepspeed.initialize(model=model, config=ds_config, model_parameters=model.parameters())
    for step in range(STEPS):
        counts.clear()
        loss = engine(input_ids=ids(), labels=ids()).loss
        engine.backward(loss)
        norm = deepspeed.utils.safe_get_full_grad(engine.module.lm_head.weight).norm().item()
        engine.step()
        report(chunk, stream, step, loss, norm, dict(counts))


def ids():
    return torch.randint(0, SIZES["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(1))


def report(chunk, stream, step, loss, lm_head_grad_norm, gathers):
    if dist.get_rank() == 0:
        print(json.dumps({"chunk": chunk, "stream": stream, "step": step, "loss": loss.item(),
                          "lm_head_grad_norm": lm_head_grad_norm, "gathers": gathers}), flush=True)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    chunk, stream = (None if value == "none" else int(value) for value in (sys.argv[1:] + ["none"])[:2])
    zero3_run(chunk, stream)
    leave_process_group()

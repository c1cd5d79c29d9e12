"""Per-rank script (torchrun, 2 processes, gloo): torch FSDP1 / FSDP2 training steps, flag off vs on.

    torchrun --nproc_per_node 2 tests/distributed/fsdp_run.py WRAPPER OUT_FILE

WRAPPER: fsdp1_orig_params, fsdp1_flat_params (FSDP1 with `use_orig_params` True / False) or fsdp2
(`fully_shard`). Not through the Trainer: accelerate runs DDP instead of FSDP on a machine without an
accelerator (see trainer_run.py). Same models, data and checks as trainer_run.py: each decoder layer
is its own unit, and so is an untied `lm_head` (Mistral; Llama ties it to the embedding, which must
stay in the root unit). A plain loop: SGD lr 0.5, gradient accumulation 2 (summed mean losses / 2),
3 steps, the same VARIANTS (the Trainer's `gradient_checkpointing=True` is
`model.gradient_checkpointing_enable()` here, before wrapping). Rank 0 saves the micro-batch losses,
initial and final full weights of each run, the recomputation counts of trainer_run.py, and the
number of all-gathers per step (flags on must gather as often as flags off: a streamed layer gathers
its weights once for its whole backward, not once per chunk).
"""

import functools
import os
import sys

import torch
import torch.distributed as dist
from trainer_run import COUNTS, FAMILIES, VARIANTS, buffer_names, build_model, count_recomputation, dataset
from leave import leave_process_group  # noqa: E402

STEPS, ACCUMULATION, MICRO_BATCH = 3, 2, 2


def units(model):
    """The modules that get their own FSDP unit (the root is wrapped last)."""
    decoder_layers = list(model.model.layers)
    return decoder_layers + ([] if model.config.tie_word_embeddings else [model.lm_head])


def wrap_fsdp1(model, use_orig_params):
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

    own_units = set(units(model))
    policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda module: module in own_units)
    return FullyShardedDataParallel(model, auto_wrap_policy=policy, use_orig_params=use_orig_params,
                                    device_id=torch.device("cpu"))


def full_state_fsdp1(wrapped):
    from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel, StateDictType

    with FullyShardedDataParallel.state_dict_type(wrapped, StateDictType.FULL_STATE_DICT,
                                                  FullStateDictConfig(offload_to_cpu=False, rank0_only=False)):
        return wrapped.state_dict()


def wrap_fsdp2(model):
    from torch.distributed.fsdp import fully_shard

    for unit in units(model):
        fully_shard(unit)
    fully_shard(model)
    return model


def full_state_fsdp2(model):
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}


GATHERS = [0]


def count_gathers():
    """Count FSDP1 flat-parameter all-gathers and FSDP2 parameter-group all-gathers."""
    from torch.distributed.fsdp import _flat_param
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    def counting(original):
        def wrapper(*args, **kwargs):
            GATHERS[0] += 1
            return original(*args, **kwargs)

        return wrapper

    handle = _flat_param.FlatParamHandle
    handle._all_gather_flat_param = counting(handle._all_gather_flat_param)
    _fsdp_param_group.foreach_all_gather = counting(_fsdp_param_group.foreach_all_gather)


WRAPPERS = {
    "fsdp1_orig_params": (lambda m: wrap_fsdp1(m, True), full_state_fsdp1),
    "fsdp1_flat_params": (lambda m: wrap_fsdp1(m, False), full_state_fsdp1),
    "fsdp2": (wrap_fsdp2, full_state_fsdp2),
}


def train(family, variant, wrapper):
    wrap, full_state = WRAPPERS[wrapper]
    model = build_model(family, variant)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    buffers = buffer_names(model)
    trainer_args = dict(VARIANTS[variant][family][1])
    if trainer_args.pop("gradient_checkpointing", False):
        model.gradient_checkpointing_enable()
    assert not trainer_args, f"fsdp_run.py has no equivalent of the Trainer arguments {trainer_args}"
    COUNTS.update(dict.fromkeys(COUNTS, 0))
    checkpointing = model.is_gradient_checkpointing
    model = wrap(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    rows = dataset(model.config.vocab_size)
    rank, world = dist.get_rank(), dist.get_world_size()
    losses, gathers = [], []
    for step in range(STEPS):
        GATHERS[0] = 0
        for micro in range(ACCUMULATION):
            first = ((step * ACCUMULATION + micro) * world + rank) * MICRO_BATCH
            batch = {key: torch.stack([row[key] for row in rows[first:first + MICRO_BATCH]]) for key in rows[0]}
            loss = model(**batch).loss / ACCUMULATION
            loss.backward()
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
        gathers.append(GATHERS[0])
    state = {k: v.detach().float().cpu().clone() for k, v in full_state(model).items()}
    return {"losses": losses, "initial": initial, "state": state, "gathers": gathers, **COUNTS,
            "gradient_checkpointing": checkpointing, "buffers": buffers}


def main():
    wrapper, out_file = sys.argv[1], sys.argv[2]
    if wrapper not in WRAPPERS:
        raise SystemExit(f"unknown wrapper {wrapper!r}; choose one of {sorted(WRAPPERS)}")
    dist.init_process_group("gloo")
    count_gathers()
    count_recomputation()
    results = {(family, variant): train(family, variant, wrapper) for family in FAMILIES for variant in VARIANTS}
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(results, out_file)
    leave_process_group()


if __name__ == "__main__":
    main()

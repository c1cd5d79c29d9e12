"""Adjoint sharding across processes: one batch of long sequences split in time over the ranks.

Run with torchrun on N CPU processes (gloo). Every rank builds the same tiny Mamba / FalconMamba
(flags on), takes its part of each sequence (`shard_batch`), runs forward/backward, and sums the
gradients over the ranks (`all_reduce_gradients`); rank 0 also trains the unsplit model with flags
off in one process. Both take the same SGD steps. Rank 0 writes JSON: per step the summed loss and
the reference loss, and at the end the largest weight difference and the parameters that moved.

    torchrun --nproc_per_node 2 mamba_sequence_run.py FAMILY OUT.json [--seq S] [--steps K]
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import make_model  # noqa: E402
from leave import leave_process_group  # noqa: E402
from transformers.adjoint_sharding import sequence  # noqa: E402


def batch(seq, step):
    gen = torch.Generator().manual_seed(100 + step)
    input_ids = torch.randint(1, 128, (2, seq), generator=gen)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :5] = 0  # left padding: inside rank 0's part
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[0, torch.randperm(seq, generator=gen)[: seq // 4]] = -100
    return input_ids, attention_mask, labels


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("family")
    parser.add_argument("out")
    parser.add_argument("--seq", type=int, default=45)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    flags = {"adjoint_sharding_chunk": 4, "mini_sequence_chunk": 8}
    model = make_model(args.family, **flags).train()
    link = sequence.shard_sequence(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    reference = make_model(args.family).train() if rank == 0 else None
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5) if rank == 0 else None
    steps = []
    for step in range(args.steps):
        input_ids, attention_mask, labels = batch(args.seq, step)
        part = sequence.shard_batch(link, input_ids, labels, attention_mask)
        optimizer.zero_grad(set_to_none=True)
        loss = model(**part).loss
        loss.backward()
        sequence.all_reduce_gradients(model, link)
        total = loss.detach().clone()
        dist.all_reduce(total)
        optimizer.step()
        if rank == 0:
            ref_optimizer.zero_grad(set_to_none=True)
            ref_loss = reference(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
            ref_loss.backward()
            ref_optimizer.step()
            steps.append({"loss": total.item(), "reference_loss": ref_loss.item(),
                          "part_tokens": part["input_ids"].shape[1]})
    if rank == 0:
        initial = make_model(args.family)
        weights = dict(model.named_parameters())
        result = {
            "steps": steps,
            "max_weight_diff": max((weights[n] - p).abs().max().item() for n, p in reference.named_parameters()),
            "unmoved": [n for n, p in initial.named_parameters() if torch.equal(p, weights[n])],
            "world_size": dist.get_world_size(),
        }
        Path(args.out).write_text(json.dumps(result))
    leave_process_group()  # rank 0 trains the reference too: the barrier there waits for it


if __name__ == "__main__":
    main()

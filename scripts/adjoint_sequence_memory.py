"""Per-process peak memory and step time of adjoint sharding with one sequence split in time over
N processes (docs/adjoint-sharding.md; target: 2 processes at S=16K, per-rank peak <= 0.6 of 1 process).

Run under torchrun with N = 1, then N = 2 (same arguments); each run prints one line per rank and
appends a JSON line to --out. Model: Mamba, hidden 256, state 16, expand 2, 4 layers, vocab 32000,
batch 1, fp32, adjoint_sharding_chunk="auto" + mini_sequence_chunk="auto", a full training step
(forward, backward, gradient all-reduce, AdamW). Peak: the live-tensor peak of the step
(`LiveTensorTracker`) plus the weights and optimizer states alive before it, the same quantity as
the bench's; measured on the second step (the first allocates the optimizer states).

    torchrun --nproc_per_node 1 scripts/adjoint_sequence_memory.py --seq 16384 --out out/adjoint_sequence.jsonl
    torchrun --nproc_per_node 2 scripts/adjoint_sequence_memory.py --seq 16384 --out out/adjoint_sequence.jsonl
"""

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

import transformers
from transformers.adjoint_sharding import sequence
from transformers.mst_core.memory import LiveTensorTracker
from transformers.mst_core.memory import resident_training_bytes


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--out", type=Path, default=Path("out/adjoint_sequence.jsonl"))
    args = parser.parse_args()
    dist.init_process_group("gloo")
    config = transformers.MambaConfig(vocab_size=32000, hidden_size=256, state_size=16, expand=2, num_hidden_layers=4,
                                      adjoint_sharding_chunk="auto", mini_sequence_chunk="auto")
    torch.manual_seed(0)
    model = transformers.MambaForCausalLM(config).train()
    link = sequence.shard_sequence(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, config.vocab_size, (1, args.seq), generator=torch.Generator().manual_seed(args.seq))
    part = sequence.shard_batch(link, ids, ids)

    def step():
        loss = model(**part).loss
        loss.backward()
        sequence.all_reduce_gradients(model, link)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    resident = resident_training_bytes(model, optimizer)
    dist.barrier()
    start = time.perf_counter()
    with LiveTensorTracker() as tracker:
        step()
    seconds = time.perf_counter() - start
    row = {"processes": link.size, "rank": link.rank, "seq": args.seq, "part_tokens": part["input_ids"].shape[1],
           "peak_mib": (resident + tracker.peak_bytes) / 2**20, "resident_mib": resident / 2**20, "step_s": seconds}
    rows = [None] * link.size
    dist.all_gather_object(rows, row)
    if link.rank == 0:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("a") as f:
            for r in rows:
                print(json.dumps(r))
                f.write(json.dumps(r) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Per-rank memory of one training step under Ulysses sequence parallelism (sp=2, 2 CPU processes over gloo).

Each rank holds S/2 tokens of the bench's Llama (d=256, 2 layers, V=32000, fp32), DeepSpeed's Ulysses attention
registered as accelerate registers it, and runs one forward + backward on its shard (pre-shifted labels, as DeepSpeed's
data loader gives them). Measured on each rank: the peak of live tensor bytes during the step (mst_core/memory.py's
LiveTensorTracker: every tensor an operator returns, counted until freed) and, for the streamed methods, the bytes of
the layer inputs the streamed layers saved for backward (the offload extension point of streaming_backward/offload.py,
given a storage that keeps each input where it is and counts it). "peak - inputs" is what a rank holds besides its
saved layer inputs, which layer-input offload moves to host memory.

    python scripts/ulysses_memory.py --seq 8192 16384 32768 --out docs/bench/ulysses_memory
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

MIB = 2**20
METHOD_NAMES = ("mini_sequence+checkpointing", "mini_sequence+streaming")


class CountingStorage:
    """The streamed layers' input storage (streaming_backward/offload.py extension point): keeps each input where it
    is (no copy) and counts its bytes."""

    def __init__(self):
        self.saved_bytes = 0

    def save(self, x):
        self.saved_bytes += x.numel() * x.element_size()
        return x

    def load(self, saved, start, end, device):
        return saved[:, start:end]


def rank_main(args):
    import deepspeed
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).parent))
    import transformers
    from bench import BASE
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.mst_core.memory import LiveTensorTracker
    from transformers.mst_planner.plan import METHODS

    deepspeed.init_distributed(dist_backend="gloo")
    rank, sp = dist.get_rank(), dist.get_world_size()
    rows = []
    for seq in args.seq:
        local = seq // sp
        ids = torch.randint(0, args.vocab, (1, seq + 1), generator=torch.Generator().manual_seed(seq))
        shard = slice(rank * local, (rank + 1) * local)
        inputs = ids[:, :-1][:, shard]
        shift_labels = ids[:, 1:][:, shard]
        positions = torch.arange(seq)[None, shard]
        for name in args.methods:
            method = METHODS[name]
            config = transformers.LlamaConfig(
                **{**BASE, "vocab_size": args.vocab, "num_key_value_heads": args.kv_heads}, mini_sequence_chunk=method.mini_sequence_chunk,
                streaming_backward_chunk=method.streaming_backward_chunk, attn_implementation="sdpa",
            )
            torch.manual_seed(0)
            model = transformers.LlamaForCausalLM(config).train()
            model.config.use_cache = False
            storage = None
            if method.streaming_backward_chunk is not None:
                storage = CountingStorage()
                model.activation_checkpointing_enable(offload=True)
                for layer in model.model.layers:
                    layer._gradient_checkpointing_func.offload = storage
            elif method.checkpointing:
                model.gradient_checkpointing_enable()
            UlyssesSPAttentionHF.register_with_transformers(
                model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=sp,
                micro_batch_size=1, seq_length_is_variable=True,
            )
            with LiveTensorTracker() as tracker:
                loss = model(input_ids=inputs, position_ids=positions, labels=shift_labels,
                             shift_labels=shift_labels).loss
                loss.backward()
            inputs_bytes = storage.saved_bytes if storage is not None else None
            rows.append({
                "rank": rank, "sp": sp, "seq_len": seq, "tokens_per_rank": local, "method": name,
                "peak_MiB": round(tracker.peak_bytes / MIB, 1),
                "saved_inputs_MiB": None if inputs_bytes is None else round(inputs_bytes / MIB, 1),
                "peak_minus_inputs_MiB": None if inputs_bytes is None else round((tracker.peak_bytes - inputs_bytes) / MIB, 1),
                "loss": round(loss.item(), 6),
            })
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
            del model, loss
            parallel_state_sp._release_sequence_parallel_groups()  # the next model registers afresh
    gathered = [None] * sp
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        Path(args.rank_out).write_text(json.dumps([r for part in gathered for r in part], indent=1))
    dist.destroy_process_group()


def summary(rows):
    lines = ["| S (whole) | tokens per rank | method | rank | peak, MiB | saved layer inputs, MiB | peak - inputs, MiB |",
             "|---:|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        inputs = "" if r["saved_inputs_MiB"] is None else r["saved_inputs_MiB"]
        rest = "" if r["peak_minus_inputs_MiB"] is None else r["peak_minus_inputs_MiB"]
        lines.append(f"| {r['seq_len']} | {r['tokens_per_rank']} | {r['method']} | {r['rank']} | {r['peak_MiB']} | "
                     f"{inputs} | {rest} |")
    streamed = [r for r in rows if r["peak_minus_inputs_MiB"] is not None and r["method"] == "mini_sequence+streaming"]
    if streamed:
        for rank in sorted({r["rank"] for r in streamed}):
            mine = sorted((r for r in streamed if r["rank"] == rank), key=lambda r: r["seq_len"])
            first, last = mine[0], mine[-1]
            lines.append(f"\nrank {rank}, mini_sequence+streaming: peak - inputs {first['peak_minus_inputs_MiB']} MiB "
                         f"at S={first['seq_len']} -> {last['peak_minus_inputs_MiB']} MiB at S={last['seq_len']} "
                         f"({round(last['peak_minus_inputs_MiB'] / first['peak_minus_inputs_MiB'], 3)}x)")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, nargs="+", default=[8192, 16384, 32768], help="whole-sequence tokens")
    parser.add_argument("--methods", nargs="+", default=list(METHOD_NAMES), choices=METHOD_NAMES)
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary size (the bench's: 32000)")
    parser.add_argument("--kv-heads", type=int, default=4, help="key/value heads of the 4 heads (the bench's: 4)")
    parser.add_argument("--out", type=Path, help="folder for ulysses_memory.json / .md")
    parser.add_argument("--rank-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if any(seq % 2 for seq in args.seq):
        parser.error(f"--seq {args.seq}: each must be even (sp=2 ranks hold S/2 tokens each)")
    if args.rank_out:
        return rank_main(args)
    torchrun = Path(sys.executable).parent / "torchrun"
    out = args.out or Path(".")
    out.mkdir(parents=True, exist_ok=True)
    rank_out = out / "ulysses_memory.json"
    cmd = [str(torchrun), "--standalone", "--nproc_per_node=2", __file__, "--rank-out", str(rank_out),
           "--seq", *map(str, args.seq), "--methods", *args.methods, "--vocab", str(args.vocab),
           "--kv-heads", str(args.kv_heads)]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    subprocess.run(cmd, env=env, check=True)
    rows = json.loads(rank_out.read_text())
    text = summary(rows)
    (out / "ulysses_memory.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

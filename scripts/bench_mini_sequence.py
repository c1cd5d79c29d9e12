"""Issue-3 targets on CPU: live-tensor peak and step time, flag off vs `mini_sequence_chunk`.

For each family, a Llama-style config (d=256, I=1024, V=32000, 2 layers) and one training
step (forward + backward) on random tokens:
- peak live tensor bytes (LiveTensorTracker: exact bytes of tensors allocated during the step;
  the weights, which exist before, are not counted) at --mem-seq (default 4096), and the loss;
- step time (median of --repeats steps after a warm-up, flag off and on interleaved so machine
  noise hits both alike) at each --time-seq length.
Prints a markdown table; --out FILE also writes it there.
"""

import argparse
import statistics
import sys
import time

import torch

import transformers
from transformers.mini_sequence import LiveTensorTracker

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    # Gemma-2 has no SDPA path upstream (softcapped attention) and flex attention has no CPU
    # backward: on CPU it runs eager attention, whose [heads, S, S] scores are in its peak.
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 64}),
}
BASE = dict(hidden_size=256, intermediate_size=1024, vocab_size=32000, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=65536)


def build(family, chunk, checkpointing=False):
    config_name, model_name, extra = FAMILIES[family]
    config = getattr(transformers, config_name)(**BASE, **extra, mini_sequence_chunk=chunk)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    return model


def step(model, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return loss.detach()


def tokens(seq):
    return torch.randint(0, BASE["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(seq))


def measure_peak(family, chunk, seq, checkpointing):
    model, ids = build(family, chunk, checkpointing), tokens(seq)
    with LiveTensorTracker() as tracker:
        loss = step(model, ids)
    return tracker.peak_bytes, loss.item()


def measure_times(family, chunk, seq, repeats, checkpointing):
    models = {c: build(family, c, checkpointing) for c in (None, chunk)}
    ids = tokens(seq)
    times = {c: [] for c in models}
    for c in models:
        step(models[c], ids)  # warm-up
    for _ in range(repeats):
        for c, model in models.items():
            start = time.perf_counter()
            step(model, ids)
            times[c].append(time.perf_counter() - start)
    return statistics.median(times[None]), statistics.median(times[chunk])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--chunk", default="auto", help='mini_sequence_chunk to compare with None (default "auto")')
    parser.add_argument("--mem-seq", type=int, default=4096)
    parser.add_argument("--time-seq", type=int, nargs="*", default=[512, 4096], help="none: memory only")
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing on, flag off and on")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", help="also write the markdown table to this file")
    args = parser.parse_args(argv)
    chunk = args.chunk if args.chunk == "auto" else int(args.chunk)

    lines = [
        f"transformers {transformers.__version__}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"config d=256 I=1024 V=32000 2 layers, batch 1, mini_sequence_chunk={chunk!r}, "
        f"gradient checkpointing {'on' if args.checkpointing else 'off'}",
        "",
        "| family | peak off (MiB) | peak on (MiB) | on/off | loss off | loss on |"
        + "".join(f" time off / on @S={s} (s) | ratio |" for s in args.time_seq),
        "|---|---:|---:|---:|---:|---:|" + "---:|---:|" * len(args.time_seq),
    ]
    for family in args.families:
        peak_off, loss_off = measure_peak(family, None, args.mem_seq, args.checkpointing)
        peak_on, loss_on = measure_peak(family, chunk, args.mem_seq, args.checkpointing)
        row = (f"| {family} | {peak_off / 2**20:.1f} | {peak_on / 2**20:.1f} | {peak_on / peak_off:.3f} "
               f"| {loss_off:.6f} | {loss_on:.6f} |")
        for seq in args.time_seq:
            t_off, t_on = measure_times(family, chunk, seq, args.repeats, args.checkpointing)
            row += f" {t_off:.3f} / {t_on:.3f} | {t_on / t_off:.3f} |"
        lines.append(row)
        print(row, file=sys.stderr, flush=True)
    lines += ["", f"peak: live tensor bytes during forward+backward at S={args.mem_seq} (CPU, LiveTensorTracker); "
              f"time: median of {args.repeats} steps after a warm-up, off/on interleaved; ratio = on / off."]
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()

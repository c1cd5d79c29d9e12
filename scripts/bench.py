"""Memory and time of training with and without mini-sequences. Three sweeps:

  methods   one model family, a sweep of sequence lengths S, the methods vanilla,
            checkpointing, mini_sequence, mini_sequence+checkpointing: peak memory and step
            time of one full training step (forward, backward, AdamW step).
  blocks    the paper's App. F sweep (Tables 13-16): the MLP block and the LM-head + loss
            block alone, time and peak memory vs the number of mini-sequences M and S.
  families  the four families at one S, flag off vs on (issue-3 targets).

Peak memory: on CUDA `torch.cuda.max_memory_allocated` after `reset_peak_memory_stats`
(everything: weights, gradients, optimizer states, activations). On CPU the exact peak of
live tensor bytes (`LiveTensorTracker`, a TorchDispatchMode) during the step, plus the bytes
of the weights and optimizer states that existed before it: the same quantity as the CUDA
allocator's, without allocator rounding or caching. Step time: median of --repeats steps
after a warm-up, with the methods interleaved so that machine noise hits them alike.

Each sweep writes <out>/<sweep>.csv and .md and PNG plots (matplotlib) and prints the table.
<out> is out/bench/ by default (ignored by git, so a run leaves the checkout clean); the
results committed under docs/bench/ are written on purpose with --out docs/bench (or
`make bench OUT=docs`).
"""

import argparse
import csv
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

import transformers
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.mini_sequence import LiveTensorTracker, mini_sequence_causal_lm_loss, mini_sequence_mlp
from transformers.mini_sequence.memory import resident_training_bytes
from transformers.mini_sequence.plan import METHODS  # name -> (mini_sequence_chunk, gradient checkpointing)

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    # Gemma-2 has no SDPA path upstream (softcapped attention) and flex attention has no CPU
    # backward: on CPU it runs eager attention, whose [heads, S, S] scores are in its peak.
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 64}),
}
# Llama-style small config (issue 3/4): big vocabulary and MLP relative to d, as in real models.
BASE = dict(hidden_size=256, intermediate_size=1024, vocab_size=32000, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1 << 17)
MIB = 2**20
REPO = Path(__file__).resolve().parents[1]


def device_of(name):
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def build(family, chunk, checkpointing, device, dtype=torch.float32, **overrides):
    config_name, model_name, extra = FAMILIES[family]
    config = getattr(transformers, config_name)(**{**BASE, **extra, **overrides}, mini_sequence_chunk=chunk)
    if device.type == "cuda" and family != "gemma2":
        config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).to(device=device, dtype=dtype).train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    return model


def tokens(seq, vocab, device):
    return torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(seq)).to(device)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Trainee:
    """A model, its AdamW and a batch: `step()` runs one full training step."""

    def __init__(self, family, chunk, checkpointing, seq, device, dtype):
        self.model = build(family, chunk, checkpointing, device, dtype)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.ids = tokens(seq, self.model.config.vocab_size, device)
        self.device = device

    def step(self):
        loss = self.model(input_ids=self.ids, labels=self.ids).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()

    def timed_step(self):
        sync(self.device)
        start = time.perf_counter()
        self.step()
        sync(self.device)
        return time.perf_counter() - start

    def peak_step(self):
        """(peak bytes of one step including weights and optimizer states, loss)."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            loss = self.step()
            return torch.cuda.max_memory_allocated(self.device), loss
        resident = resident_training_bytes(self.model, self.optimizer)
        with LiveTensorTracker() as tracker:
            loss = self.step()
        return resident + tracker.peak_bytes, loss


def compare_steps(trainees, repeats, progress):
    """Warm-up (allocates optimizer states), one measured-memory step, then interleaved timed steps."""
    results = {}
    for name, trainee in trainees.items():
        first_loss = trainee.step()
        peak, _ = trainee.peak_step()
        results[name] = {"peak_bytes": peak, "first_loss": first_loss, "times": []}
        progress.update(2)
    for _ in range(repeats):
        for name, trainee in trainees.items():
            results[name]["times"].append(trainee.timed_step())
            progress.update(1)
    for r in results.values():
        r["step_time_s"] = statistics.median(r.pop("times"))
    return results


# ----------------------------------------------------------------------------- the sweeps


def sweep_methods(args, device):
    rows = []
    steps = len(args.seq) * len(METHODS) * (2 + args.repeats)
    with tqdm(total=steps, desc=f"methods ({args.family})", file=sys.stderr) as progress:
        for seq in args.seq:
            trainees = {m: Trainee(args.family, c, ckpt, seq, device, args.dtype) for m, (c, ckpt) in METHODS.items()}
            for method, r in compare_steps(trainees, args.repeats, progress).items():
                rows.append({"family": args.family, "seq_len": seq, "method": method, **r})
            del trainees
    for r in rows:
        r["peak_MiB"] = round(r.pop("peak_bytes") / MIB, 1)
    vanilla = {r["seq_len"]: r for r in rows if r["method"] == "vanilla"}
    checkpointing = {r["seq_len"]: r for r in rows if r["method"] == "checkpointing"}
    for r in rows:
        r["peak_vs_vanilla"] = round(r["peak_MiB"] / vanilla[r["seq_len"]]["peak_MiB"], 3)
        r["peak_vs_checkpointing"] = round(r["peak_MiB"] / checkpointing[r["seq_len"]]["peak_MiB"], 3)
        r["time_vs_vanilla"] = round(r["step_time_s"] / vanilla[r["seq_len"]]["step_time_s"], 3)
    for r in rows:  # rounded only once every ratio is computed from the full values
        r["step_time_s"] = round(r["step_time_s"], 3)
        r["first_loss"] = round(r["first_loss"], 6)
    return rows


def sweep_blocks(args, device):
    """MLP and LM head + loss alone, forward + backward, vs M (App. F); M=1 is the upstream code."""
    d, inter, vocab = BASE["hidden_size"], BASE["intermediate_size"], BASE["vocab_size"]
    config = transformers.LlamaConfig(**BASE)
    torch.manual_seed(0)
    mlp = transformers.models.llama.modeling_llama.LlamaMLP(config).to(device, args.dtype)
    head = torch.nn.Linear(d, vocab, bias=False).to(device, args.dtype)
    rows = []
    jobs = [(block, seq, m) for block in ("mlp", "lm_head") for seq in args.seq for m in args.mini_sequences]
    for block, seq, m in tqdm(jobs, desc="blocks", file=sys.stderr):
        x = torch.randn(1, seq, d, device=device, dtype=args.dtype, requires_grad=True)
        labels = tokens(seq, vocab, device)
        chunk = math.ceil(seq / m)
        if block == "mlp":
            def run():
                out = mlp(x) if m == 1 else mini_sequence_mlp(mlp, x, chunk)
                out.backward(torch.ones_like(out))
        else:
            def run():
                if m == 1:
                    loss = ForCausalLMLoss(head(x), labels, vocab)
                else:
                    loss = mini_sequence_causal_lm_loss(x, head, labels, chunk_size=chunk, vocab_size=vocab)
                loss.backward()
        run()  # warm-up
        times = []
        for _ in range(args.repeats):
            sync(device)
            start = time.perf_counter()
            run()
            sync(device)
            times.append(time.perf_counter() - start)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            run()
            peak = torch.cuda.max_memory_allocated(device)
        else:
            with LiveTensorTracker() as tracker:
                run()
            peak = tracker.peak_bytes
        rows.append({"block": block, "seq_len": seq, "mini_sequences": m, "chunk_tokens": chunk,
                     "peak_MiB": round(peak / MIB, 1), "time_s": round(statistics.median(times), 4)})
        x.grad = None
        mlp.zero_grad(set_to_none=True)
        head.zero_grad(set_to_none=True)
    return rows


def sweep_families(args, device):
    rows = []
    steps = len(args.families) * 2 * (2 + args.repeats)
    with tqdm(total=steps, desc="families", file=sys.stderr) as progress:
        for family in args.families:
            trainees = {c: Trainee(family, c, args.checkpointing, args.seq[0], device, args.dtype) for c in (None, args.chunk)}
            r = compare_steps(trainees, args.repeats, progress)
            off, on = r[None], r[args.chunk]
            rows.append({"family": family, "seq_len": args.seq[0], "chunk": args.chunk,
                         "checkpointing": args.checkpointing,
                         "peak_off_MiB": round(off["peak_bytes"] / MIB, 1), "peak_on_MiB": round(on["peak_bytes"] / MIB, 1),
                         "peak_on_vs_off": round(on["peak_bytes"] / off["peak_bytes"], 3),
                         "loss_off": round(off["first_loss"], 6), "loss_on": round(on["first_loss"], 6),
                         "time_off_s": round(off["step_time_s"], 3), "time_on_s": round(on["step_time_s"], 3),
                         "time_on_vs_off": round(on["step_time_s"] / off["step_time_s"], 3)})
    return rows


# ----------------------------------------------------------------------------- output


def markdown(rows):
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def plot(rows, x, y, line, title, path, ylabel, logx=False):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in dict.fromkeys(r[line] for r in rows):
        points = sorted((r[x], r[y]) for r in rows if r[line] == name)
        ax.plot(*zip(*points), marker="o", label=str(name))
    ax.set_xlabel(x)
    ax.set_ylabel(ylabel)
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(rows, out, name, header):
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{name}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    table = f"{header}\n\n{markdown(rows)}\n"
    (out / f"{name}.md").write_text(table)
    print(table)


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep", choices=["methods", "blocks", "families"])
    parser.add_argument("--family", default="llama", choices=list(FAMILIES), help="for `methods`")
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES), help="for `families`")
    parser.add_argument("--seq", type=int, nargs="+", help="sequence lengths (default per sweep)")
    parser.add_argument("--mini-sequences", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32], help="M, for `blocks`")
    parser.add_argument("--chunk", default="auto", help='mini_sequence_chunk for `families` (default "auto")')
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing on, for `families`")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per point (median)")
    parser.add_argument("--device", default="auto", help="cpu, cuda, or auto (cuda if available)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--out", type=Path, default=REPO / "out" / "bench",
                        help="output folder (default out/bench, ignored by git; docs/bench holds the committed results)")
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.chunk != "auto":
        args.chunk = int(args.chunk)
    args.dtype = getattr(torch, args.dtype)
    args.seq = args.seq or {"methods": [1024, 2048, 4096, 8192], "blocks": [2048, 8192], "families": [4096]}[args.sweep]
    if any(s < 2 for s in args.seq) or args.repeats < 1:
        parser.error("--seq values must be >= 2 and --repeats >= 1")
    device = device_of(args.device)

    where = (f"{torch.cuda.get_device_name(device)} (CUDA allocator peak)" if device.type == "cuda"
             else f"CPU, {torch.get_num_threads()} threads (live tensor bytes + weights and optimizer states)")
    header = (f"transformers {transformers.__version__}, torch {torch.__version__}, {where}; "
              f"d={BASE['hidden_size']} I={BASE['intermediate_size']} V={BASE['vocab_size']} "
              f"{BASE['num_hidden_layers']} layers, batch 1, {str(args.dtype).removeprefix('torch.')}; "
              f"time = median of {args.repeats} steps after a warm-up")
    if args.sweep == "methods":
        rows = sweep_methods(args, device)
        write(rows, args.out, f"methods_{args.family}", header)
        plot(rows, "seq_len", "peak_MiB", "method", f"{args.family}: peak memory of a training step\n{where}",
             args.out / f"methods_{args.family}_memory.png", "peak (MiB)", logx=True)
        plot(rows, "seq_len", "step_time_s", "method", f"{args.family}: time of a training step\n{where}",
             args.out / f"methods_{args.family}_time.png", "step time (s)", logx=True)
    elif args.sweep == "blocks":
        rows = sweep_blocks(args, device)
        write(rows, args.out, "blocks", header.replace("batch 1", "batch 1, one block alone, forward + backward"))
        for block in ("mlp", "lm_head"):
            part = [dict(r, S=f"S={r['seq_len']}") for r in rows if r["block"] == block]
            plot(part, "mini_sequences", "peak_MiB", "S", f"{block}: peak memory vs M (App. F)\n{where}",
                 args.out / f"blocks_{block}_memory.png", "peak (MiB)", logx=True)
            plot(part, "mini_sequences", "time_s", "S", f"{block}: time vs M (App. F)\n{where}",
                 args.out / f"blocks_{block}_time.png", "forward + backward (s)", logx=True)
    else:
        rows = sweep_families(args, device)
        write(rows, args.out, "families", header)


if __name__ == "__main__":
    main()

"""Train a small Llama on long sequences of real text, with and without mini-sequences.

The text is the Python standard library's own source (every machine has it), tokenized by a
byte-level BPE tokenizer trained on it with `tokenizers` (32K vocabulary, so the LM head
matters). From the same initial weights and on the same batches, a few AdamW steps run with
`mini_sequence_chunk` unset (upstream) and set ("auto" by default). It prints the per-step
losses side by side (they must agree), the peak memory and the time of each step, and saves
a plot. With --model PATH it trains that local checkpoint instead, with its own tokenizer.

Peak memory: on CUDA `torch.cuda.max_memory_allocated`; on CPU the exact peak of live tensor
bytes during the step (LiveTensorTracker) plus the weights and optimizer states.
"""

import argparse
import copy
import sys
import sysconfig
import time
from pathlib import Path

import torch
from tqdm import tqdm

import transformers
from transformers.mini_sequence import LiveTensorTracker, validate_mini_sequence_chunk
from transformers.mini_sequence.memory import resident_training_bytes

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20


def stdlib_text(max_chars):
    """The standard library's .py files in sorted order (no site-packages), up to max_chars."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return "".join(parts)[:max_chars]


def bpe_tokenizer(text, vocab_size, cache_dir, max_chars):
    """A byte-level BPE trained on `text`, cached by its settings (training takes a while)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = cache_dir / f"bpe-v{vocab_size}-c{max_chars}.json"
    if path.exists():
        return Tokenizer.from_file(str(path))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    print(f"training a {vocab_size}-token BPE tokenizer on {len(text) / 1e6:.1f}M characters ...", flush=True)
    tokenizer.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return tokenizer


def peak_of(step, model, optimizer, device):
    """Run `step()`; return (its result, peak bytes including weights and optimizer states)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return step(), torch.cuda.max_memory_allocated(device)
    resident = resident_training_bytes(model, optimizer)
    with LiveTensorTracker() as tracker:
        result = step()
    return result, resident + tracker.peak_bytes


def train(model, batches, device, lr):
    """A few AdamW steps; per step: loss, peak bytes, seconds."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    records = []
    for ids in tqdm(batches, desc=f"mini_sequence_chunk={model.config.mini_sequence_chunk!r}", file=sys.stderr):
        ids = ids.to(device)

        def step():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.item()

        start = time.perf_counter()
        loss, peak = peak_of(step, model, optimizer, device)
        records.append({"loss": loss, "peak": peak, "seconds": time.perf_counter() - start})
    return records


def plot(path, runs, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_mem, ax_time) = plt.subplots(1, 3, figsize=(12, 3.8))
    for label, records in runs.items():
        ax_loss.plot(range(1, len(records) + 1), [r["loss"] for r in records], marker="o", label=label)
    ax_loss.set(xlabel="step", ylabel="loss", title="loss per step")
    ax_loss.legend()
    labels = list(runs)
    ax_mem.bar(labels, [max(r["peak"] for r in runs[k]) / MIB for k in labels], color=["tab:blue", "tab:orange"])
    ax_mem.set(ylabel="MiB", title="peak memory of a step")
    ax_time.bar(labels, [sorted(r["seconds"] for r in runs[k])[len(runs[k]) // 2] for k in labels],
                color=["tab:blue", "tab:orange"])
    ax_time.set(ylabel="s", title="step time (median)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="a local Hugging Face checkpoint directory (default: a small random Llama)")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--chunk", default="auto", help='mini_sequence_chunk of the second run: "auto" or a positive int')
    parser.add_argument("--vocab-size", type=int, default=32000, help="BPE vocabulary of the default model")
    parser.add_argument("--max-chars", type=int, default=4_000_000, help="characters of stdlib source to use")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", type=Path, default=REPO / "docs" / "demo.png")
    parser.add_argument("--cache-dir", type=Path, default=REPO / ".cache" / "demo", help="where the tokenizer is cached")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    try:
        args.chunk = validate_mini_sequence_chunk("auto" if args.chunk == "auto" else int(args.chunk))
    except ValueError as err:
        parser.error(f"--chunk: {err}")
    if args.chunk is None:
        parser.error("--chunk: must be set")
    if args.seq_len < 2 or args.steps < 1 or args.vocab_size < 260:
        parser.error("--seq-len must be >= 2, --steps >= 1, --vocab-size >= 260")
    if args.model is not None and not (args.model / "config.json").is_file():
        parser.error(f"--model {args.model}: no config.json there (expected a local Hugging Face checkpoint directory)")
    return args


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    wall = time.perf_counter()
    text = stdlib_text(args.max_chars)
    if args.model is None:
        tokenizer = bpe_tokenizer(text, args.vocab_size, args.cache_dir, args.max_chars)
        ids = tokenizer.encode(text).ids
        config = transformers.LlamaConfig(
            vocab_size=tokenizer.get_vocab_size(), hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
            num_attention_heads=4, max_position_embeddings=args.seq_len,
        )
        torch.manual_seed(args.seed)
        initial = transformers.LlamaForCausalLM(config)

        def fresh(chunk):
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**config.to_dict(), "mini_sequence_chunk": chunk}))
            model.load_state_dict(initial.state_dict())
            return model
    else:
        ids = transformers.AutoTokenizer.from_pretrained(args.model)(text)["input_ids"]
        state = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).state_dict()

        def fresh(chunk):
            model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, mini_sequence_chunk=chunk)
            model.load_state_dict(copy.deepcopy(state))
            return model

    needed = args.steps * args.seq_len
    if len(ids) < needed:
        sys.exit(f"error: the text gives {len(ids)} tokens, {needed} are needed; raise --max-chars")
    batches = [torch.tensor(ids[i * args.seq_len:(i + 1) * args.seq_len]).unsqueeze(0) for i in range(args.steps)]

    runs = {}
    for label, chunk in (("flag off", None), (f"chunk={args.chunk!r}", args.chunk)):
        model = fresh(chunk).to(device)
        params = sum(p.numel() for p in model.parameters())
        name, vocab = type(model).__name__, model.config.vocab_size
        runs[label] = train(model, batches, device, args.lr)
        del model

    off, on = runs.values()
    print(f"\n{name}, {params / 1e6:.1f}M parameters, vocabulary {vocab}, "
          f"{args.steps} steps of {args.seq_len} tokens, device {device}, transformers {transformers.__version__}\n")
    print(f"{'step':>4}  {'loss flag off':>14}  {'loss ' + list(runs)[1]:>14}  {'rel. diff':>9}")
    worst = 0.0
    for i, (a, b) in enumerate(zip(off, on), 1):
        diff = abs(a["loss"] - b["loss"]) / abs(a["loss"])
        worst = max(worst, diff)
        print(f"{i:>4}  {a['loss']:>14.6f}  {b['loss']:>14.6f}  {diff:>9.1e}")
    print(f"\n{'method':<16}{'peak (MiB)':>12}{'step time (s)':>16}{'final loss':>12}")
    for label, records in runs.items():
        times = sorted(r["seconds"] for r in records)
        print(f"{label:<16}{max(r['peak'] for r in records) / MIB:>12.1f}{times[len(times) // 2]:>16.2f}{records[-1]['loss']:>12.4f}")
    ratio = max(r["peak"] for r in on) / max(r["peak"] for r in off)
    where = "CUDA allocator" if device.type == "cuda" else "CPU live tensor bytes + weights + AdamW states"
    print(f"peak ratio {list(runs)[1]}/off: {ratio:.3f}  ({where})")
    plot(args.plot, runs, f"{args.seq_len}-token sequences, {params / 1e6:.1f}M-parameter Llama; peak: {where}")
    print(f"plot: {args.plot}   total wall time {time.perf_counter() - wall:.0f} s")
    if worst > 1e-4:
        sys.exit(f"error: losses differ by {worst:.1e} relative (more than 1e-4)")


if __name__ == "__main__":
    main()

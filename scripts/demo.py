"""Train a small Llama on long sequences of real text: upstream, mini-sequences, and mini-sequences + streaming.

The text is the Python standard library's own source (every machine has it), tokenized by a
byte-level BPE tokenizer trained on it with `tokenizers` (32K vocabulary, so the LM head
matters; trained once and cached under .cache/demo/). From the same initial weights and on the
same batches, a few AdamW steps run with our flags unset (upstream), with `mini_sequence_chunk`
("auto" by default), and with `mini_sequence_chunk` and `streaming_backward_chunk` ("auto" by default;
`--streaming-chunk off` leaves this run out), one step of each in turn so that a busy machine slows all
alike. It prints the per-step losses side by side (each must agree with upstream's to 1e-4 relative, else it exits 1),
the peak memory and the time of each step, a summary, and saves a plot (out/demo.png, ignored
by git so that a run leaves the checkout clean; `--plot docs/demo.png` replaces the committed one).
With --model PATH it trains that local checkpoint instead, with its own tokenizer.

Peak memory of a step (forward, backward, AdamW step), max over the steps: the weights and
optimizer states alive before the step plus everything the step allocates. On CPU the latter
is the exact peak of live tensor bytes (LiveTensorTracker; its bookkeeping is included in the
CPU step times); on CUDA it is torch.cuda.max_memory_allocated above the step's baseline.
"""

import argparse
import hashlib
import math
import sys
import sysconfig
import time
from pathlib import Path

# Only the validation helper here: it does not import torch, so bad arguments fail fast.
from transformers.mst_core.fields import validate_mini_sequence_chunk, validate_streaming_backward_chunk

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20
TOLERANCE = 1e-4


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path,
                        help="a local Hugging Face checkpoint directory, trained with its own tokenizer "
                             "(default: a 20M-parameter random-init Llama with a BPE trained on the stdlib)")
    parser.add_argument("--seq-len", type=int, default=8192, help="tokens per sequence (default 8192)")
    parser.add_argument("--steps", type=int, default=3, help="AdamW steps per run (default 3)")
    parser.add_argument("--chunk", default="auto", help='mini_sequence_chunk of the second run: "auto" (default) or a positive int')
    parser.add_argument("--streaming-chunk", default="auto",
                        help='streaming_backward_chunk of the third run (with --chunk): "auto" (default), a positive '
                             'int, or "off" (no third run)')
    parser.add_argument("--vocab-size", type=int, default=32000, help="BPE vocabulary of the default model (default 32000)")
    parser.add_argument("--hidden-size", type=int, default=256,
                        help="d of the default model (default 256; I = 4d, d/64 heads, untied LM head)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the default model (default 4)")
    parser.add_argument("--max-chars", type=int, default=4_000_000, help="characters of stdlib source to read (default 4M)")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", type=Path, default=REPO / "out" / "demo.png",
                        help="PNG to write (default out/demo.png, ignored by git; docs/demo.png is the committed one)")
    parser.add_argument("--cache-dir", type=Path, default=REPO / ".cache" / "demo", help="where the tokenizer is cached")
    parser.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: cuda if available, else cpu)")
    args = parser.parse_args(argv)
    try:
        chunk = args.chunk if args.chunk == "auto" else int(args.chunk)
        args.chunk = validate_mini_sequence_chunk(chunk)
    except ValueError:
        parser.error(f'--chunk: invalid value {args.chunk!r}: expected "auto" or a positive integer')
    try:
        value = args.streaming_chunk
        streaming = None if value == "off" else value if value == "auto" else int(value)
        args.streaming_chunk = validate_streaming_backward_chunk(streaming)
    except ValueError:
        parser.error(f'--streaming-chunk: invalid value {args.streaming_chunk!r}: expected "auto", a positive integer '
                     'or "off"')
    if args.seq_len < 2:
        parser.error(f"--seq-len must be >= 2 (the loss predicts each next token), got {args.seq_len}")
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if args.vocab_size < 260:
        parser.error(f"--vocab-size must be >= 260 (256 byte tokens + merges), got {args.vocab_size}")
    if args.hidden_size < 64 or args.hidden_size % 64 or args.layers < 1:
        parser.error(f"--hidden-size must be a positive multiple of 64 and --layers >= 1, "
                     f"got {args.hidden_size} and {args.layers}")
    if args.max_chars < 1:
        parser.error(f"--max-chars must be >= 1, got {args.max_chars}")
    if not (args.lr > 0):
        parser.error(f"--lr must be > 0, got {args.lr}")
    if args.model is not None and not (args.model / "config.json").is_file():
        what = "does not exist" if not args.model.exists() else "has no config.json"
        parser.error(f"--model {args.model}: {what} (expected a local Hugging Face checkpoint directory)")
    return args


def stdlib_sources(max_chars):
    """The standard library's .py files (no site-packages), sorted by path, up to max_chars in all."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.relative_to(root).parts:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")[: max_chars - total]
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return parts


def bpe_tokenizer(sources, vocab_size, cache_dir):
    """A byte-level BPE trained on `sources`, cached under a name keyed by its settings and text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    digest = hashlib.sha256()
    for text in sources:
        digest.update(text.encode("utf-8", errors="replace"))
    chars = sum(map(len, sources))
    path = cache_dir / f"bpe-v{vocab_size}-c{chars}-{digest.hexdigest()[:12]}.json"
    if path.exists():
        print(f"tokenizer: cached {path}", flush=True)
        return Tokenizer.from_file(str(path))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=sys.stderr.isatty())
    print(f"tokenizer: training a {vocab_size}-token byte-level BPE on {chars / 1e6:.1f}M characters "
          f"of {len(sources)} stdlib files (once; cached afterwards) ...", flush=True)
    start = time.perf_counter()
    tokenizer.train_from_iterator((line for text in sources for line in text.splitlines(keepends=True)), trainer=trainer)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tokenizer.save(str(tmp))
    tmp.replace(path)  # never leave a half-written cache entry
    print(f"tokenizer: trained in {time.perf_counter() - start:.0f} s, vocabulary {tokenizer.get_vocab_size()}, "
          f"saved to {path}", flush=True)
    return tokenizer


def token_stream(encode_batch, sources, needed):
    """Concatenated token ids of the sources, file by file, until `needed` tokens are there."""
    ids, batch = [], 64
    for i in range(0, len(sources), batch):
        for seq in encode_batch(sources[i:i + batch]):
            ids.extend(seq)
        if len(ids) >= needed:
            break
    return ids


def load_tokens(args, sources, needed):
    """Token ids of the stdlib text (at least `needed` if there is enough text), and the vocabulary size."""
    if args.model is None:
        tokenizer = bpe_tokenizer(sources, args.vocab_size, args.cache_dir)
        ids = token_stream(lambda texts: [e.ids for e in tokenizer.encode_batch(texts)], sources, needed)
        return ids, tokenizer.get_vocab_size()
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    ids = token_stream(lambda texts: tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"],
                       sources, needed)
    return ids, len(tokenizer)


def build_models(args, vocab_size):
    """{label: model}: flags off, mini-sequences, and mini-sequences + streaming (unless --streaming-chunk off),
    float32, with identical weights."""
    import torch

    import transformers

    if args.model is None:
        config = transformers.LlamaConfig(
            vocab_size=vocab_size, hidden_size=args.hidden_size, intermediate_size=4 * args.hidden_size,
            num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden_size // 64),
            max_position_embeddings=max(args.seq_len, 2048), tie_word_embeddings=False,
        )

        def load(**flags):
            torch.manual_seed(args.seed)
            return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**config.to_dict(), **flags}))
    else:
        def load(**flags):
            torch.manual_seed(args.seed)  # for weights the checkpoint lacks, if any
            return transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, **flags)

    on_label = '"auto"' if args.chunk == "auto" else f"chunk={args.chunk}"
    models = {"flag off": load(), on_label: load(mini_sequence_chunk=args.chunk)}
    if args.streaming_chunk is not None:
        models[f"{on_label} + streaming"] = load(mini_sequence_chunk=args.chunk, streaming_backward_chunk=args.streaming_chunk)
    for model in models.values():
        model.load_state_dict(models["flag off"].state_dict())  # the SAME initial weights, whatever init did
    return models


def training_step(model, optimizer, ids, device):
    import torch

    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return loss.item()


def measured_step(model, optimizer, ids, device, seed):
    """One training step; returns {loss, peak (bytes), seconds}."""
    import torch

    from transformers.mst_core.memory import LiveTensorTracker
    from transformers.mst_core.memory import resident_training_bytes

    torch.manual_seed(seed)  # same RNG state for both runs (dropout, if the checkpoint has any)
    resident = resident_training_bytes(model, optimizer)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        baseline = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        loss = training_step(model, optimizer, ids, device)
        seconds = time.perf_counter() - start
        peak = resident + torch.cuda.max_memory_allocated(device) - baseline
    else:
        start = time.perf_counter()
        with LiveTensorTracker() as tracker:
            loss = training_step(model, optimizer, ids, device)
        seconds = time.perf_counter() - start
        peak = resident + tracker.peak_bytes
    return {"loss": loss, "peak": peak, "seconds": seconds}


def median(values):
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def plot(path, runs, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(runs)
    colors = ["tab:blue", "tab:orange", "tab:green"]
    styles = [dict(marker="o", lw=4, ms=11), dict(marker="x", ls="--", lw=2, ms=9), dict(marker="+", ls=":", lw=2, ms=12)]
    fig, (ax_loss, ax_mem, ax_time) = plt.subplots(1, 3, figsize=(14, 4.2), gridspec_kw={"width_ratios": [1.3, 1, 1]})
    for (label, records), color, style in zip(runs.items(), colors, styles):
        ax_loss.plot(range(1, len(records) + 1), [r["loss"] for r in records], color=color, label=label, **style)
    ax_loss.set(xlabel="step", ylabel="training loss", title="loss per step (same weights, same batches)")
    ax_loss.xaxis.get_major_locator().set_params(integer=True)
    ax_loss.legend()
    for ax, values, unit, title_ in (
        (ax_mem, [max(r["peak"] for r in runs[k]) / MIB for k in labels], "MiB", "peak memory of a training step"),
        (ax_time, [median(r["seconds"] for r in runs[k]) for k in labels], "s", "step time (median)"),
    ):
        bars = ax.bar([label.replace(" + ", "\n+ ") for label in labels], values, color=colors[:len(labels)])
        texts = [f"{v:.0f}" if unit == "MiB" or v >= 10 else f"{v:.2f}" for v in values]
        texts[1:] = [f"{t}\n({v / values[0]:.2f}x)" if values[0] else t for t, v in zip(texts[1:], values[1:])]
        ax.bar_label(bars, labels=texts, fontsize=8)
        ax.set(ylabel=unit, title=title_)
        ax.margins(y=0.15)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    wall = time.perf_counter()

    import torch
    from tqdm import tqdm

    import transformers

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"error: --device {args.device}: this torch build sees no CUDA device", file=sys.stderr)
        return 2
    needed = args.steps * args.seq_len
    sources = stdlib_sources(args.max_chars)
    ids, vocab_size = load_tokens(args, sources, needed)
    if len(ids) < needed:
        print(f"error: {sum(map(len, sources))} characters of stdlib source give {len(ids)} tokens, {needed} are "
              f"needed (--steps x --seq-len); raise --max-chars", file=sys.stderr)
        return 2
    models = build_models(args, vocab_size)
    model_off = models["flag off"]
    batches = [torch.tensor(ids[i * args.seq_len:(i + 1) * args.seq_len]).unsqueeze(0) for i in range(args.steps)]

    params = sum(p.numel() for p in model_off.parameters())
    cfg = model_off.config
    print(f"model: {type(model_off).__name__}, {params / 1e6:.1f}M parameters (d={cfg.hidden_size}, "
          f"I={cfg.intermediate_size}, {cfg.num_hidden_layers} layers, vocabulary {cfg.vocab_size}), float32, "
          f"device {device}, transformers {transformers.__version__}")
    streamed = "" if args.streaming_chunk is None else f" and + streaming_backward_chunk={args.streaming_chunk!r}"
    print(f"data: {args.steps} batches of 1 x {args.seq_len} tokens of stdlib source; AdamW lr={args.lr}; "
          f"flags off vs mini_sequence_chunk={args.chunk!r}{streamed}, one step of each in turn", flush=True)

    runs = {label: [] for label in models}
    optimizers = {}
    for label, model in models.items():
        model.to(device).train()
        optimizers[label] = torch.optim.AdamW(model.parameters(), lr=args.lr)
    train_start = time.perf_counter()
    with tqdm(total=len(models) * args.steps, desc="training", unit="step", file=sys.stderr) as bar:
        for i, batch in enumerate(batches):
            batch = batch.to(device)
            for label, model in models.items():
                bar.set_postfix_str(f"step {i + 1}/{args.steps}, {label}")
                runs[label].append(measured_step(model, optimizers[label], batch, device, args.seed + i))
                bar.update()
    train_seconds = time.perf_counter() - train_start

    labels = list(runs)
    off = runs["flag off"]
    width = max(map(len, labels)) + 7  # "loss <label>" and two spaces
    print("\n" + f"{'step':>4}" + "".join(f"{'loss ' + label:>{width}}" for label in labels)
          + f"{'max rel. diff':>15}" + "".join(f"{'time ' + label + ' (s)':>{width + 4}}" for label in labels))
    worst = 0.0
    for i in range(args.steps):
        losses = [runs[label][i]["loss"] for label in labels]
        diff = max(abs(loss - losses[0]) / max(abs(losses[0]), 1e-12) for loss in losses[1:])
        worst = diff if math.isnan(diff) else max(worst, diff)
        print(f"{i + 1:>4}" + "".join(f"{loss:>{width}.6f}" for loss in losses) + f"{diff:>15.1e}"
              + "".join(f"{runs[label][i]['seconds']:>{width + 4}.2f}" for label in labels))
    ok = worst <= TOLERANCE  # False for NaN too
    print(f"max relative loss difference: {worst:.1e} ({'OK' if ok else 'FAIL'}, tolerance {TOLERANCE:.0e})")

    where = "CUDA allocator" if device.type == "cuda" else "CPU live tensor bytes + weights + AdamW states"
    print(f"\n{'method':<{width}}{'peak (MiB)':>12}{'step time (s)':>16}{'final loss':>12}")
    for label, records in runs.items():
        print(f"{label:<{width}}{max(r['peak'] for r in records) / MIB:>12.1f}"
              f"{median(r['seconds'] for r in records):>16.2f}{records[-1]['loss']:>12.4f}")
    for label in labels[1:]:
        peak_ratio = max(r["peak"] for r in runs[label]) / max(r["peak"] for r in off)
        time_ratio = median(r["seconds"] for r in runs[label]) / median(r["seconds"] for r in off)
        print(f"peak ratio {label}/off: {peak_ratio:.3f}   step time ratio {label}/off: {time_ratio:.2f}")
    print(f"(peak: max over steps, {where}; step time: median of {args.steps} step(s))")

    plot(args.plot, runs, f"{type(model_off).__name__}, {params / 1e6:.1f}M parameters, {args.seq_len}-token "
                          f"sequences, device {device}; peak = {where}")
    print(f"plot: {args.plot}")
    print(f"wall time: training {train_seconds:.0f} s, total {time.perf_counter() - wall:.0f} s")
    if not ok:
        print(f"error: the losses differ by {worst:.1e} relative, more than {TOLERANCE:.0e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

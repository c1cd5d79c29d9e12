"""LM-head anchors: our chunked LM head + causal-LM loss against two public chunked ones, in ONE run.

Methods, each computing the mean causal-LM loss of ``lm_head(hidden)`` (bias-free head, labels shifted by one
as upstream does, ignore_index -100, the first 10% of the labels ignored) and, in the same step, the gradients
for the hidden states and the head weight:

  torch-lce   ``torch.nn.functional.linear_cross_entropy(h, W, shift_labels, reduction="mean",
              ignore_index=-100, options=torch.nn.LinearCrossEntropyOptions())``: torch's chunked op with its
              defaults ("auto": on CPU fp32 -> acc_policy "compact", chunks "aspect_ratio:2"; bf16 -> "accurate"
              with fp32 accumulation, "aspect_ratio"). The chunk size its "auto" picks at the full shape is
              read from ``LinearCrossEntropyOptions._adjust`` (what the op itself calls to resolve "auto").
  ALST        DeepSpeed's ``TiledFusedLogitsLoss`` (Arctic Long Sequence Training, arXiv:2506.13996), called as
              ALST's Hugging Face integration calls it: per-shard fn = ``lm_head`` then upstream's
              ``ForCausalLMLoss`` (here with ``num_items_in_batch`` = the number of predicted tokens, so that
              the shard sums add up to the mean), ``output_reduction="sum"``, ``compute_params=[W]``, and
              ALST's shard count: ceil(fp32 logits bytes / 1 GiB). Its weight gradient accumulates in
              ``W.grad`` (in W's dtype) during the forward.
  ours        ``mini_sequence_causal_lm_loss(..., chunk_size=lm_head_chunk_size("auto", d, V, S))``
              (src/transformers/mini_sequence/loss.py: fp32 goes to ``linear_cross_entropy`` with our chunk
              size; bf16 to our chunked autograd Function).
  upstream    unsplit ``ForCausalLMLoss(lm_head(h), labels, V)``: the reference for memory and time, holding
              the [S, V] logits (and their fp32 copy, log-probabilities, gradients).

For fp32 and bf16 (head weight and hidden states in that dtype), S in --tokens, V in --vocabs, d = --hidden.

Peak: live tensor bytes allocated during one step (forward + backward, the returned gradients included, the
weights and inputs excluded), from ``LiveTensorTracker``, measured under ``FakeTensorMode`` at the full shape
(shapes only: a 32K x 262144 step would need 32+ GiB of logits for upstream, and CPU bf16 matmuls are very
slow here). Before that, every method in both dtypes is run real and fake on a small shape with several
chunks (--check-tokens tokens, d=128, V=4000) and the two peaks must agree within 1%; a method that cannot run
under FakeTensorMode is measured for real at that small shape and shown as "n/a" at the full shape.

Time: median of --repeats steps after one warm-up step, at fewer tokens (--time-tokens for fp32,
--bf16-time-tokens for bf16: this CPU has no bf16 matrix instructions) with the chunk sizes of the full shape
(the same per-chunk work, fewer chunks; a chunk is never larger than the tokens timed). Cases are
interleaved round by round; a case whose step is identical at the timed size for both S (same method, dtype,
V and effective chunk) is timed once and shown for both. Ratios are to the fastest exact method of that
(dtype, S, V).

Exactness: the timed steps' own loss and gradients against an fp64 reference from the same inputs (upstream's
``ForCausalLMLoss`` in fp64, summed over 256-row blocks to bound its memory; the sum is linear, the blocks change
only fp64 rounding): relative errors ||x - ref|| / ||ref||. "exact" = each of the three errors at most
``max(2 x upstream's same-dtype error, 1e-6)``.

Threads: --threads, default 1. On this shared 2-core machine (load ~4 from other work) every parallel region of a
2-thread run waits for a descheduled thread: a [8, 32000] fp32 log_softmax took 47 ns per element with 2
threads and 2.7 with 1 (about 6 for a [64, 32000] one either way), which penalizes whichever method issues more,
smaller ops (row blocks, tiny chunks) by an artifact of the machine, not of the method.

--device cuda (on a GPU): every method really runs at the full shape, d = --hidden: time = median of --repeats
steps after one warm-up, peak = the CUDA allocator's high-water mark above the inputs and weight, errors against
fp64 only up to --reference-tokens (default 8192); torch-lce and ALST are left out, with the reason printed,
where torch lacks the op or deepspeed does not import. docs/cuda/README.md has runs on an H100:
    python scripts/lm_head_anchors.py --device cuda --hidden 4096 --dtypes bf16 --tokens 8192 32768 --json F

--peaks-only skips timing and exactness (the peak phase is cheap at any d: fake tensors); --ours-chunk torch
gives ours torch's chunk size, to separate the chunk policy from the mechanism.

The default grid is sized for a 2-core CPU (d=256 instead of a real model's 2048-8192; say so when quoting).
The committed docs/bench/lm_head_anchors.txt (38 minutes on a 2-core machine under a load of 4-7; most of it the
fake peaks of torch's op at 4-16-token chunks and the bf16 matmuls):
    .venv/bin/python scripts/lm_head_anchors.py --time-tokens 1024 --bf16-time-tokens 32 --repeats 2 --bf16-repeats 2
and docs/bench/lm_head_anchors_d4096.txt (peaks at a real model's d):
    .venv/bin/python scripts/lm_head_anchors.py --hidden 4096 --peaks-only
"""

import argparse
import contextlib
import math
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lm_head_memory import MIB, fake_parameters, make_inputs  # noqa: E402
import policy_overrides  # noqa: E402

from transformers.loss.loss_utils import ForCausalLMLoss  # noqa: E402
from transformers.mini_sequence import config, loss  # noqa: E402
from transformers.mst_core.memory import LiveTensorTracker  # noqa: E402

METHODS = ("torch-lce", "ALST", "ours", "upstream")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
IGNORE = -100


def shifted(labels):
    """Upstream ForCausalLMLoss's shift: pad with -100, drop the first label."""
    return F.pad(labels, (0, 1), value=IGNORE)[..., 1:].contiguous()


# --- chunk settings at the full shape -------------------------------------------------------------


def torch_lce_chunk(tokens, hidden_size, vocab, dtype, device="cpu"):
    """The batch chunk size torch's default options resolve to for this shape (None: torch has no such op)."""
    if not hasattr(torch.nn, "LinearCrossEntropyOptions"):
        return None
    options = torch.nn.LinearCrossEntropyOptions()
    return options._adjust(tokens, hidden_size, vocab, dtype, torch.device(device)).batch_chunk_size


def alst_shards(tokens, vocab):
    """ALST's automatic shard count: about 1 GiB of fp32 logits per shard."""
    return max(1, math.ceil(tokens * vocab * 4 / 2**30))


def full_shape_chunks(tokens, hidden_size, vocab, dtype, ours_chunk="auto", device="cpu"):
    """Tokens per chunk of each method at the full shape (upstream: all tokens). ``ours_chunk="torch"``
    gives ours torch's chunk size (a diagnostic: the chunk policy apart from the mechanism)."""
    lce = torch_lce_chunk(tokens, hidden_size, vocab, dtype, device)
    return {
        "torch-lce": lce,
        "ALST": math.ceil(tokens / alst_shards(tokens, vocab)),
        "ours": lce if ours_chunk == "torch" else config.lm_head_chunk_size("auto", hidden_size, vocab, tokens),
        "upstream": tokens,
    }


# --- one forward + backward per method: (loss, hidden grad, weight grad) ---------------------------


def run_torch_lce(head, hidden, labels, chunk, default_options=False):
    h = hidden.detach().requires_grad_()
    options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=None if default_options else chunk)
    value = F.linear_cross_entropy(h.reshape(-1, h.shape[-1]), head.weight, shifted(labels).reshape(-1),
                                   reduction="mean", ignore_index=IGNORE, options=options)
    return (value, *torch.autograd.grad(value, [h, head.weight]))


def run_alst(head, hidden, labels, chunk):
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

    vocab = head.weight.shape[0]
    shift = shifted(labels)
    num_items = (shift != IGNORE).sum()

    def shard_loss(module, x, y):
        return ForCausalLMLoss(module(x), None, vocab, num_items_in_batch=num_items, shift_labels=y)

    h = hidden.detach().requires_grad_()
    head.weight.grad = None
    shards = math.ceil(h.shape[1] / chunk)
    value = TiledFusedLogitsLoss.apply(shard_loss, head, h, shift, None, shards, [head.weight], "sum")
    # A constant 1.0 (not autograd's ones_like): its backward compares the incoming gradient with 1.0,
    # which FakeTensorMode can only answer for a constant.
    torch.autograd.backward(value, torch.tensor(1.0, device=value.device))
    grads = (h.grad, head.weight.grad)
    h.grad = head.weight.grad = None
    return (value.detach(), *grads)


def ours_slices_vocabulary(tokens, hidden_size, vocab, dtype):
    """Whether ours takes its vocabulary-sliced backward at this shape (loss.py's own test, on fake tensors)."""
    with FakeTensorMode():
        head = torch.nn.Linear(hidden_size, vocab, bias=False, dtype=dtype)
        hidden = torch.empty(tokens, hidden_size, dtype=dtype)
    return loss._vocab_sliced_backward_pays(head, hidden, [head.weight], vocab)


def run_ours(head, hidden, labels, chunk, sliced=None):
    """``sliced``: the backward the full shape takes (`ours_slices_vocabulary`), kept at the timed token count, which
    may decide otherwise; None: whatever loss.py picks."""
    h = hidden.detach().requires_grad_()
    decide = loss._vocab_sliced_backward_pays
    if sliced is not None:
        loss._vocab_sliced_backward_pays = lambda *args: sliced
    try:
        value = loss.mini_sequence_causal_lm_loss(h, head, labels, chunk_size=chunk, vocab_size=head.weight.shape[0])
    finally:
        loss._vocab_sliced_backward_pays = decide
    return (value, *torch.autograd.grad(value, [h, head.weight]))


def run_upstream(head, hidden, labels, chunk=None):
    h = hidden.detach().requires_grad_()
    value = ForCausalLMLoss(head(h), labels, head.weight.shape[0])
    return (value, *torch.autograd.grad(value, [h, head.weight]))


RUNNERS = {"torch-lce": run_torch_lce, "ALST": run_alst, "ours": run_ours, "upstream": run_upstream}


def fp64_reference(head, hidden, labels, rows=256):
    """Upstream's loss in fp64 from the same values, 256 rows at a time (sum of the per-row terms)."""
    w = head.weight.detach().double().requires_grad_()
    h = hidden.detach().double().reshape(-1, hidden.shape[-1])
    shift = shifted(labels).reshape(-1)
    num_items = (shift != IGNORE).sum()
    total, grad_h, grad_w = torch.zeros((), dtype=torch.float64, device=h.device), torch.empty_like(h), torch.zeros_like(w)
    for start in range(0, h.shape[0], rows):
        hc = h[start:start + rows].requires_grad_()
        part = ForCausalLMLoss(hc @ w.T, None, w.shape[0], num_items_in_batch=num_items,
                               shift_labels=shift[start:start + rows], ignore_index=IGNORE)
        gh, gw = torch.autograd.grad(part, [hc, w])
        total += part.detach()
        grad_h[start:start + rows] = gh
        grad_w += gw
    return total, grad_h.reshape(hidden.shape), grad_w


def rel_err(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


# --- peaks ------------------------------------------------------------------------------------------


@contextlib.contextmanager
def fake_cpu_gemms_as_real():
    """Fake CPU tensors take the real CPU's GEMM path in our loss: FakeTensor has an fp32-output ``addmm`` (its meta
    kernel), which this CPU may lack (mst_core/grads.py: ``_fp32_out_addmm``); without this the fake peak would omit
    the fp32 copies the real CPU step holds instead."""
    from torch._subclasses.fake_tensor import FakeTensor

    from transformers.mst_core import grads

    probe = torch.zeros(1, 1)
    half = torch.zeros(1, 1, dtype=torch.bfloat16)
    key = ("cpu", FakeTensor)
    added = not grads._fp32_out_addmm(probe, half, half) and key not in grads._NO_FP32_OUT_GEMM
    if added:
        grads._NO_FP32_OUT_GEMM.add(key)
    try:
        yield
    finally:
        if added:
            grads._NO_FP32_OUT_GEMM.discard(key)


def peak_mib(method, dtype, tokens, hidden_size, vocab, chunk, fake, default_options=False):
    with contextlib.ExitStack() as stack:
        if fake:
            stack.enter_context(fake_cpu_gemms_as_real())
            stack.enter_context(FakeTensorMode())
            stack.enter_context(fake_parameters([loss]))
        head, hidden, labels = make_inputs(tokens, hidden_size, vocab, dtype)
        kwargs = {"default_options": True} if default_options else {}
        with LiveTensorTracker(keep_largest=0) as tracker:
            result = RUNNERS[method](head, hidden, labels, chunk, **kwargs)
            del result
    return tracker.peak_bytes / MIB


def check_fake(check_tokens):
    """Real vs fake peaks of every method in both dtypes at a small shape with several chunks. Returns the
    set of (method, dtype name) that could not run under FakeTensorMode; exits if a fake peak is off."""
    d, vocab = 128, 4000
    chunk = max(1, check_tokens // 4)
    no_fake = set()
    for dname, dtype in DTYPES.items():
        for method in METHODS:
            real = peak_mib(method, dtype, check_tokens, d, vocab, chunk, fake=False)
            try:
                fake = peak_mib(method, dtype, check_tokens, d, vocab, chunk, fake=True)
            except Exception as exc:  # noqa: BLE001 - report which method cannot run on fake tensors
                no_fake.add((method, dname))
                print(f"fake-peak check {dname} {method:<9}: real {real:.3f} MiB, cannot run under FakeTensorMode "
                      f"({type(exc).__name__}: {str(exc)[:120]})", flush=True)
                continue
            ok = abs(real - fake) <= 0.01 * real
            print(f"fake-peak check {dname} {method:<9}: {check_tokens} tokens d={d} V={vocab} chunk {chunk}: "
                  f"real {real:.3f} MiB, fake {fake:.3f} MiB {'ok' if ok else 'DISAGREE'}", flush=True)
            if not ok:
                raise SystemExit(f"fake and real peaks disagree for {method} {dname}")
    return no_fake


# --- on a GPU: every method really run at the full shape ---------------------------------------------


def cuda_measure(method, head, hidden, labels, chunk, ref, repeats):
    """One warm-up step (its errors against ``ref``, if given), then ``repeats`` timed steps; the peak is the
    CUDA allocator's high-water mark over the timed steps above what was allocated before (inputs, weight)."""
    kwargs = {"default_options": True} if method == "torch-lce" else {}
    row = {"method": method, "chunk": chunk}
    try:
        out = RUNNERS[method](head, hidden, labels, chunk, **kwargs)
        row["errors"] = None if ref is None else [rel_err(x, r) for x, r in zip(out, ref)]
        del out
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            out = RUNNERS[method](head, hidden, labels, chunk, **kwargs)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            del out
        row.update(time=statistics.median(times), times=times,
                   peak_mib=(torch.cuda.max_memory_allocated() - base) / MIB)
    except torch.OutOfMemoryError:
        row["oom"] = True
    out = None
    torch.cuda.empty_cache()
    return row


def cuda_main(args):
    """--device cuda: each (dtype, S, V) really run on the GPU with each method's chunk at the full shape;
    errors against an fp64 reference where S <= --reference-tokens. Rows go to --json as they come."""
    import json

    have_alst = True
    try:
        import deepspeed.runtime.sequence_parallel.ulysses_sp  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - say why the anchor is missing, measure the others
        have_alst = False
        print(f"ALST not measured: deepspeed not importable ({type(exc).__name__}: {str(exc)[:200]})", flush=True)
    if not hasattr(F, "linear_cross_entropy"):
        print(f"torch-lce not measured: torch {torch.__version__} has no F.linear_cross_entropy", flush=True)
    methods = [m for m in METHODS if (m != "ALST" or have_alst) and (m != "torch-lce" or hasattr(F, "linear_cross_entropy"))]
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "hidden": args.hidden,
              "overrides": args.overrides, "rows": []}
    for dname in args.dtypes:
        dtype = DTYPES[dname]
        for tokens in args.tokens:
            for vocab in args.vocabs:
                head, hidden, labels = make_inputs(tokens, args.hidden, vocab, dtype, seed=1, device="cuda")
                ref = fp64_reference(head, hidden, labels, rows=1024) if tokens <= args.reference_tokens else None
                chunks = full_shape_chunks(tokens, args.hidden, vocab, dtype, args.ours_chunk, device="cuda")
                for method in methods:
                    row = cuda_measure(method, head, hidden, labels, chunks[method], ref, args.repeats)
                    row.update(dtype=dname, tokens=tokens, vocab=vocab)
                    report["rows"].append(row)
                    if args.json:
                        Path(args.json).write_text(json.dumps(report, indent=1))
                    errors = "" if not row.get("errors") else " errors " + " ".join(f"{e:.1e}" for e in row["errors"])
                    print(f"{dname} S={tokens} V={vocab} {method:<9} chunk {row['chunk']}: " + (
                        "OOM" if row.get("oom") else f"{1000 * row['time']:.1f} ms, peak {row['peak_mib']:.0f} MiB"
                        + errors), flush=True)
                del head, hidden, labels, ref
                torch.cuda.empty_cache()
    return 0


# --- main -------------------------------------------------------------------------------------------


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--vocabs", type=int, nargs="+", default=[32000, 128256, 151936, 262144],
                        help="Llama-2, Llama-3, Qwen3, Gemma-3")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--time-tokens", type=int, default=1024, help="fp32 steps are timed at this many tokens")
    parser.add_argument("--bf16-time-tokens", type=int, default=128, help="bf16 steps are timed at this many tokens")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per case (after one warm-up)")
    parser.add_argument("--bf16-repeats", type=int, default=2)
    parser.add_argument("--check-tokens", type=int, default=1024, help="fake-vs-real check size")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: on a shared 2-core machine every parallel region of a "
                             "2-thread run waits for a descheduled thread; see the module docstring)")
    parser.add_argument("--peaks-only", action="store_true", help="no timing / exactness runs")
    parser.add_argument("--ours-chunk", choices=["auto", "torch"], default="auto",
                        help='"torch": ours with the chunk size torch\'s op picks (diagnostic)')
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: every method really run on the GPU at the full shape (time, allocator peak)")
    parser.add_argument("--reference-tokens", type=int, default=8192,
                        help="cuda: errors against fp64 only up to this many tokens (the reference is slow)")
    parser.add_argument("--json", help="cuda: write the rows to this file as they come")
    policy_overrides.add_arguments(parser)
    args = parser.parse_args(argv)
    args.overrides = policy_overrides.apply(args)
    if args.device == "cuda":
        warnings.filterwarnings("ignore", message=".*allow_retain_graph.*")
        return cuda_main(args)
    if min(args.tokens + args.vocabs + [args.hidden, args.time_tokens, args.bf16_time_tokens, args.repeats,
                                        args.bf16_repeats, args.check_tokens]) < 1:
        parser.error("all sizes and repeats must be positive")
    warnings.filterwarnings("ignore", message=".*allow_retain_graph.*")
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    print(f"LM head + mean causal-LM loss, forward+backward (grads: hidden, weight); d={args.hidden}; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)

    no_fake = check_fake(args.check_tokens)

    # Peaks at the full shape, under FakeTensorMode.
    peaks, chunks = {}, {}
    for dname in args.dtypes:
        dtype = DTYPES[dname]
        for vocab in args.vocabs:
            for tokens in args.tokens:
                chunks[dname, tokens, vocab] = full = full_shape_chunks(tokens, args.hidden, vocab, dtype,
                                                                        args.ours_chunk)
                for method in METHODS:
                    if (method, dname) in no_fake:
                        peaks[dname, tokens, vocab, method] = None
                        continue
                    # torch lce at the full shape: its true defaults (chunk resolved by the op itself).
                    peaks[dname, tokens, vocab, method] = peak_mib(
                        method, dtype, tokens, args.hidden, vocab, full[method], fake=True,
                        default_options=method == "torch-lce")
                sliced = ours_slices_vocabulary(tokens, args.hidden, vocab, dtype)
                print(f"peaks {dname} S={tokens} V={vocab}: " + ", ".join(
                    f"{m} {peaks[dname, tokens, vocab, m]:.1f} MiB (chunk {full[m]})" for m in METHODS)
                    + (", ours vocabulary-sliced" if sliced else "")
                    + f"  [{time.perf_counter() - started:.0f} s]", flush=True)

    if args.peaks_only:
        print(f"peaks only (MiB, fake tensors), d={args.hidden}, ours' chunk: {args.ours_chunk}")
        print(f"{'dtype':<5} {'S':>6} {'V':>7} " + " ".join(f"{m + ' (chunk)':>20}" for m in METHODS))
        for (dname, tokens, vocab), full in chunks.items():
            print(f"{dname:<5} {tokens:>6} {vocab:>7} " + " ".join(
                f"{peaks[dname, tokens, vocab, m]:>12.1f} ({full[m]:>5})" for m in METHODS))
        print(f"total {time.perf_counter() - started:.0f} s", flush=True)
        return 0

    # Timing + exactness at fewer tokens, with the full shape's chunk sizes.
    results = {}
    for dname in args.dtypes:
        dtype = DTYPES[dname]
        time_tokens = args.time_tokens if dname == "fp32" else args.bf16_time_tokens
        repeats = args.repeats if dname == "fp32" else args.bf16_repeats
        for vocab in args.vocabs:
            head, hidden, labels = make_inputs(time_tokens, args.hidden, vocab, dtype, seed=1)
            ref = fp64_reference(head, hidden, labels)
            # Distinct steps: (method, effective chunk) -> the S values they stand for.
            steps = {}
            for tokens in args.tokens:
                for method in METHODS:
                    eff = min(chunks[dname, tokens, vocab][method], time_tokens)
                    sliced = ours_slices_vocabulary(tokens, args.hidden, vocab, dtype) if method == "ours" else None
                    steps.setdefault((method, eff, sliced), []).append(tokens)
            times = {key: [] for key in steps}
            errors = {}
            for round_ in range(repeats + 1):  # round 0: warm-up
                for key in steps:
                    method, eff, sliced = key
                    start = time.perf_counter()
                    out = RUNNERS[method](head, hidden, labels, eff, **({} if sliced is None else {"sliced": sliced}))
                    elapsed = time.perf_counter() - start
                    if round_:
                        times[key].append(elapsed)
                    else:
                        errors[key] = tuple(rel_err(x, r) for x, r in zip(out, ref))
                    del out
                print(f"timing {dname} V={vocab} at {time_tokens} tokens: round {round_}/{repeats} done "
                      f"[{time.perf_counter() - started:.0f} s]", flush=True)
            for key, s_values in steps.items():
                for tokens in s_values:
                    results[dname, tokens, vocab, key[0]] = {
                        "chunk": chunks[dname, tokens, vocab][key[0]], "time": statistics.median(times[key]),
                        "times": times[key], "errors": errors[key], "time_tokens": time_tokens}
            del head, hidden, labels, ref

    print_table(args, peaks, results, no_fake)
    print(f"total {time.perf_counter() - started:.0f} s", flush=True)
    return 0


def print_table(args, peaks, results, no_fake):
    print()
    print("peak: MiB live during the step at S tokens (fake tensors); time: ms per step at the timed token count "
          "(median), x = time / fastest exact; errors vs fp64: loss, hidden grad, weight grad; * = exact")
    header = (f"{'dtype':<5} {'S':>6} {'V':>7} {'method':<10} {'chunk':>6} {'peak MiB':>9} {'tok':>5} "
              f"{'time ms':>9} {'x':>6} {'err loss':>9} {'err dh':>9} {'err dW':>9} exact")
    print(header)
    print("-" * len(header))
    for dname in args.dtypes:
        for vocab in args.vocabs:
            for tokens in args.tokens:
                rows = {m: results[dname, tokens, vocab, m] for m in METHODS}
                bound = [max(2 * e, 1e-6) for e in rows["upstream"]["errors"]]
                for r in rows.values():
                    r["exact"] = all(e <= b for e, b in zip(r["errors"], bound))
                fastest = min(r["time"] for r in rows.values() if r["exact"])
                for method, r in rows.items():
                    peak = peaks[dname, tokens, vocab, method]
                    peak_text = "n/a" if peak is None else f"{peak:.1f}"
                    e = r["errors"]
                    print(f"{dname:<5} {tokens:>6} {vocab:>7} {method:<10} {r['chunk']:>6} {peak_text:>9} "
                          f"{r['time_tokens']:>5} {1000 * r['time']:>9.1f} {r['time'] / fastest:>6.2f} "
                          f"{e[0]:>9.2e} {e[1]:>9.2e} {e[2]:>9.2e} {'*' if r['exact'] else '-'}")
    if no_fake:
        print("no FakeTensorMode run (peak n/a at the full shape; real peak in the check above): "
              + ", ".join(f"{m} {d}" for m, d in sorted(no_fake)))
    print("verdict per (dtype, S, V): fastest exact / lowest peak")
    for dname in args.dtypes:
        for vocab in args.vocabs:
            for tokens in args.tokens:
                rows = {m: results[dname, tokens, vocab, m] for m in METHODS}
                exact = [m for m in METHODS if rows[m]["exact"]]
                fastest = min(exact, key=lambda m: rows[m]["time"])
                known = [m for m in METHODS if peaks[dname, tokens, vocab, m] is not None]
                lowest = min(known, key=lambda m: peaks[dname, tokens, vocab, m])
                print(f"  {dname} S={tokens} V={vocab}: fastest exact {fastest}, lowest peak {lowest} "
                      f"({peaks[dname, tokens, vocab, lowest]:.1f} MiB)")


if __name__ == "__main__":
    sys.exit(main())

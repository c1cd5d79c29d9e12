"""Live-tensor peak and time of the chunked LM head + causal-LM loss, in ONE run:

  fp32 path      fp32 head: torch's F.linear_cross_entropy (what mini_sequence_causal_lm_loss picks)
  bf16 before    bf16 head: loss.py (and its "auto" chunk policy) as of git revision --before
  bf16 after     bf16 head: the installed loss.py

Forward + backward of the head and loss (gradients for the hidden states and the head weight),
"auto" chunk size. Peak: ``LiveTensorTracker`` (exact live tensor bytes
allocated during the step, weights and inputs excluded, also inside torch's custom ops: before 5.24.0+mst.10 it
missed the [chunk, V] logits of ``F.linear_cross_entropy``, a custom op whose body a dispatch mode does not see). Time: median of --repeats steps after a warm-up, the cases
interleaved so that machine noise hits them alike; ratios are printed because the machine is
noisy.

CPUs without bf16 matrix instructions run bf16 matmuls 10-50x slower than fp32 ones (a bf16 step
at 8192 tokens, d=512, V=32000 takes 10+ minutes on 2 AVX2 cores), hence two options:
--fake-peaks measures the bf16 peaks under ``FakeTensorMode`` (shapes only; the run first checks
that fake and real peaks agree on a small shape), and --time-tokens times the steps at fewer
tokens with the chunk sizes of the full shape (the same per-chunk work, fewer chunks).

With --accuracy-tokens N > 0, the gradients at N tokens are also compared with an fp64
reference computed from the same bf16 inputs and weights (relative norm errors), next to
upstream's own unsplit bf16 ``ForCausalLMLoss(lm_head(h), labels)``.

Needs git (the "before" code is read with ``git show``). Example:
    .venv/bin/python scripts/lm_head_memory.py --fake-peaks --time-tokens 1024
"""

import argparse
import contextlib
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.mini_sequence import config, loss
from transformers.mst_core.memory import LiveTensorTracker

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20
# The commit before the bf16 LM-head memory work.
BEFORE = "dcab507a4f80c838f85084b4192b696c418b20f3"


def load_module_at(rev, relpath, name):
    """The module at ``relpath`` as it was at git revision ``rev``, imported as ``name``."""
    source = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{rev}:{relpath}"], check=True, capture_output=True, text=True
    ).stdout
    module = types.ModuleType(name)
    module.__package__ = "transformers.mini_sequence"  # its relative imports use today's helpers
    exec(compile(source, f"{rev[:10]}:{relpath}", "exec"), module.__dict__)
    return module


def make_inputs(tokens, hidden_size, vocab, dtype, seed=0, device="cpu"):
    """A bias-free head, hidden states [1, tokens, d] (both in ``dtype``, same values for every
    dtype up to rounding) and labels with the first 10% ignored (prompt tokens), drawn on ``device``."""
    gen = torch.Generator(device).manual_seed(seed)
    head = nn.Linear(hidden_size, vocab, bias=False, dtype=dtype, device=device)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden_size, generator=gen, device=device) / hidden_size**0.5)
    hidden = torch.randn(1, tokens, hidden_size, generator=gen, device=device).to(dtype)
    labels = torch.randint(0, vocab, (1, tokens), generator=gen, device=device)
    labels[0, : tokens // 10] = -100
    return head, hidden, labels


def step(loss_fn, head, hidden, labels, chunk, vocab):
    h = hidden.detach().requires_grad_()
    out = loss_fn(h, head, labels, chunk_size=chunk, vocab_size=vocab)
    return out, torch.autograd.grad(out, [h, head.weight])


@contextlib.contextmanager
def fake_parameters(modules):
    """Under FakeTensorMode parameters are FakeTensors, not ``nn.Parameter``: ``function_parameters``
    would send the head down the wrapper path. Let it take them (the head is a plain Linear)."""
    saved = [m.function_parameters for m in modules]
    for m in modules:
        m.function_parameters = lambda module: [p for p in module.parameters() if p.requires_grad]
    try:
        yield
    finally:
        for m, f in zip(modules, saved):
            m.function_parameters = f


def peak_mib(fn, module, dtype, tokens, hidden_size, vocab, chunk, fake=False):
    with FakeTensorMode() if fake else contextlib.nullcontext(), fake_parameters([module]) if fake else contextlib.nullcontext():
        head, hidden, labels = make_inputs(tokens, hidden_size, vocab, dtype)
        with LiveTensorTracker(keep_largest=0) as tracker:
            result = step(fn, head, hidden, labels, chunk, vocab)
            del result
    return tracker.peak_bytes / MIB


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--before", default=BEFORE, help="git revision of the 'bf16 before' code")
    parser.add_argument("--fake-peaks", action="store_true", help="bf16 peaks under FakeTensorMode")
    parser.add_argument("--time-tokens", type=int, default=None, help="time at this many tokens (default --tokens)")
    parser.add_argument("--accuracy-tokens", type=int, default=0)
    args = parser.parse_args()

    old_loss = load_module_at(args.before, "src/transformers/mini_sequence/loss.py", "_mst_loss_before")
    old_config = load_module_at(args.before, "src/transformers/mini_sequence/config.py", "_mst_config_before")
    shape = (args.hidden, args.vocab, args.tokens)
    # name -> (loss function, its module, head dtype, chunk size at the full shape)
    cases = {
        "fp32 path": (loss.mini_sequence_causal_lm_loss, loss, torch.float32, config.lm_head_chunk_size("auto", *shape)),
        "bf16 before": (old_loss.mini_sequence_causal_lm_loss, old_loss, torch.bfloat16,
                        old_config.lm_head_chunk_size("auto", *shape)),
        "bf16 after": (loss.mini_sequence_causal_lm_loss, loss, torch.bfloat16, config.lm_head_chunk_size("auto", *shape)),
    }
    print(f"{args.tokens} tokens, d={args.hidden}, V={args.vocab}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; forward+backward of LM head + loss", flush=True)

    if args.fake_peaks:
        small = (1024, 128, 4000, 256)  # tokens, d, V, chunk
        for name, (fn, module, dtype, _) in cases.items():
            if dtype == torch.bfloat16:
                real, fake = (peak_mib(fn, module, dtype, *small, fake=f) for f in (False, True))
                print(f"fake-peak check, {name}, {small[0]} tokens d={small[1]} V={small[2]} chunk {small[3]}: "
                      f"real {real:.3f} MiB, fake {fake:.3f} MiB")
                if abs(real - fake) > 0.01 * real:
                    raise SystemExit("fake and real peaks disagree: run without --fake-peaks")
    results = {}
    for name, (fn, module, dtype, chunk) in cases.items():
        fake = args.fake_peaks and dtype == torch.bfloat16
        peak = peak_mib(fn, module, dtype, args.tokens, args.hidden, args.vocab, chunk, fake=fake)
        results[name] = {"chunk": chunk, "peak": peak, "fake": fake, "times": []}
        print(f"{name}: peak {peak:.1f} MiB{' (fake tensors)' if fake else ''}", flush=True)

    time_tokens = args.time_tokens or args.tokens
    inputs = {dtype: make_inputs(time_tokens, args.hidden, args.vocab, dtype) for dtype in (torch.float32, torch.bfloat16)}
    for round_ in range(args.repeats + 1):  # round 0: warm-up
        for name, (fn, module, dtype, chunk) in cases.items():
            start = time.perf_counter()
            step(fn, *inputs[dtype], chunk, args.vocab)
            if round_:
                results[name]["times"].append(time.perf_counter() - start)
        print(f"timing round {round_} done", flush=True)

    ref = results["fp32 path"]
    print(f"time at {time_tokens} tokens (median of {args.repeats}), peak at {args.tokens} tokens:")
    print(f"{'case':<12} {'chunk':>6} {'peak MiB':>9} {'peak/fp32':>9} {'time s':>8} {'time/fp32':>9}")
    for name, r in results.items():
        r["time"] = statistics.median(r["times"])
        print(f"{name:<12} {r['chunk']:>6} {r['peak']:>9.1f} {r['peak'] / ref['peak']:>9.2f} "
              f"{r['time']:>8.2f} {r['time'] / ref['time']:>9.2f}")
    before, after = results["bf16 before"], results["bf16 after"]
    print(f"bf16 after/before: peak {after['peak'] / before['peak']:.2f}, time {after['time'] / before['time']:.2f} "
          f"(times s: before {' '.join('%.2f' % t for t in before['times'])}, "
          f"after {' '.join('%.2f' % t for t in after['times'])})")

    if args.accuracy_tokens:
        accuracy(args, old_loss, old_config)
    return 0


def accuracy(args, old_loss, old_config):
    n = args.accuracy_tokens
    head16, hidden16, labels = make_inputs(n, args.hidden, args.vocab, torch.bfloat16, seed=1)
    head64 = nn.Linear(args.hidden, args.vocab, bias=False).double()
    with torch.no_grad():
        head64.weight.copy_(head16.weight)

    def upstream(h, head, labels, chunk_size, vocab_size):
        return ForCausalLMLoss(head(h), labels, vocab_size)

    shape = (args.hidden, args.vocab, n)
    ref_loss, ref_grads = step(upstream, head64, hidden16.double(), labels, None, args.vocab)
    runs = {
        "upstream bf16": step(upstream, head16, hidden16, labels, None, args.vocab),
        "bf16 before": step(old_loss.mini_sequence_causal_lm_loss, head16, hidden16, labels,
                            old_config.lm_head_chunk_size("auto", *shape), args.vocab),
        "bf16 after": step(loss.mini_sequence_causal_lm_loss, head16, hidden16, labels,
                           config.lm_head_chunk_size("auto", *shape), args.vocab),
    }

    def rel(a, b):
        return ((a.double() - b).norm() / b.norm()).item()

    print(f"accuracy at {n} tokens vs fp64 from the same bf16 inputs (relative norm error):")
    print(f"{'case':<14} {'loss':>9} {'hidden grad':>12} {'weight grad':>12}")
    for name, (value, grads) in runs.items():
        print(f"{name:<14} {rel(value, ref_loss):>9.2e} {rel(grads[0], ref_grads[0]):>12.3e} "
              f"{rel(grads[1], ref_grads[1]):>12.3e}")


if __name__ == "__main__":
    sys.exit(main())

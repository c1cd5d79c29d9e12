"""Host work of the mini-sequence MLP by chunk count: a CPU stand-in for what a GPU waits on.

    python scripts/mlp_host_cost.py [--tokens 1024] [--chunks 2 4 8] [--repeats 400]

A bf16 LlamaMLP so small (d=32, I=64) that its kernels take next to nothing: forward + backward time is then the
host's work, Python and dispatch. Timed, interleaved round by round, median after a warm-up: the mini-sequence
Function (`mini_sequence_mlp`, mini_sequence/mlp.py) with the sequence in N chunks, the unsplit MLP under torch's
non-reentrant checkpoint (what checkpointing runs) and plain. Half-precision weights on CUDA have their gradients
summed by one fp32-output GEMM per chunk (`LinearWeightGradsSummed`, mst_core/grads.py), a path this CPU lacks; it is
taken here with that GEMM stood in by one torch call, so the host work is the GPU's path. On a GPU a chunk's kernels
must take longer than this host work or the GPU idles between them (docs/cuda/README.md, "Next on a GPU")."""

import argparse
import statistics
import time

import torch
import transformers
from transformers.mini_sequence.mlp import mini_sequence_mlp
from transformers.mst_core import grads


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--chunks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--repeats", type=int, default=400)
    args = parser.parse_args(argv)
    if min(args.chunks) < 2 or args.tokens < max(args.chunks) or args.repeats < 2:
        parser.error("need chunks >= 2, tokens >= the largest chunk count and repeats >= 2")
    torch.set_num_threads(1)
    # the fp32-output GEMM of CUDA, stood in by one call (no CPU kernel has it)
    grads._fp32_out_addmm = lambda acc, a, b: acc.add_(1.0) is acc
    torch.manual_seed(0)
    mlp = transformers.models.llama.modeling_llama.LlamaMLP(
        transformers.LlamaConfig(hidden_size=32, intermediate_size=64)).to(torch.bfloat16)
    x = torch.randn(1, args.tokens, 32, dtype=torch.bfloat16, requires_grad=True)
    cases = {f"mini-sequence Function, {n} chunks": (lambda n=n: mini_sequence_mlp(mlp, x, -(-args.tokens // n)))
             for n in args.chunks}
    cases["checkpointed, unsplit"] = lambda: torch.utils.checkpoint.checkpoint(mlp, x, use_reentrant=False)
    cases["plain, unsplit"] = lambda: mlp(x)
    times = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, forward in cases.items():
            start = time.perf_counter()
            forward().sum().backward()
            times[name].append(time.perf_counter() - start)
    print(f"bf16 LlamaMLP d=32 I=64, {args.tokens} tokens, forward + backward, 1 thread, torch {torch.__version__}, "
          f"transformers {transformers.__version__}; median of {args.repeats - args.repeats // 8} after a warm-up")
    for name, measured in times.items():
        print(f"{name:36s} {statistics.median(measured[args.repeats // 8:]) * 1e3:7.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Host work of the mini-sequence MLP by chunk count: a CPU stand-in for what a GPU waits on.

    python scripts/mlp_host_cost.py [--tokens 1024] [--chunks 2 4 8] [--repeats 400] [--dtype float32] [--compiled]

A LlamaMLP so small (d=32, I=64; bf16 by default) that its kernels take next to nothing: forward + backward time is
then the host's work, Python and dispatch. Timed, interleaved round by round, median after a warm-up: the
mini-sequence Function (`mini_sequence_mlp`, mini_sequence/mlp.py) with the sequence in N chunks, the unsplit MLP under
torch's non-reentrant checkpoint (what checkpointing runs) and plain. Half-precision weights on CUDA have their
gradients summed by one fp32-output GEMM per chunk (`LinearWeightGradsSummed`, mst_core/grads.py), a path this CPU
lacks; it is taken here with that GEMM stood in by one torch call, so the host work is the GPU's path. On a GPU a
chunk's kernels must take longer than this host work or the GPU idles between them (docs/cuda/README.md, "Next on a
GPU").

`--compiled` adds the same Function with each chunk's body compiled (`torch.compile` of the MLP's own forward,
`fullgraph=True`, static shapes: one graph per chunk length and grad mode; AOTAutograd compiles its backward), the
lever "a compiled chunk body" weighs; fp32 only (the bf16 path's fp32-sum mode is a `TorchFunctionMode` around the
chunk, which this does not trace). The first call's time (compilation) is printed apart.

`launches`: what one forward + backward starts, counted by torch.profiler: every aten operator that calls no other
aten operator (a kernel, or host work in place of one; views included) and every kernel inductor generated
(`cpp.enable_kernel_profile`), which bypasses the dispatcher."""

import argparse
import collections
import statistics
import time

import torch
import torch._inductor.config
import transformers
from transformers.mini_sequence.mlp import chunked_function, mini_sequence_mlp, module_forward
from transformers.mst_core import grads


def launches(step) -> int:
    """Leaf aten operators and generated kernels of one call of `step` (see the module docstring)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()

    def counted(event):
        return event.name.startswith("aten::") or "cpp_fused" in event.name

    return sum(1 for event in prof.events() if counted(event) and not any(counted(c) for c in event.cpu_children))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--chunks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--repeats", type=int, default=400)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--compiled", action="store_true", help="also time each chunk's body compiled (fp32 only)")
    args = parser.parse_args(argv)
    if min(args.chunks) < 2 or args.tokens < max(args.chunks) or args.repeats < 2:
        parser.error("need chunks >= 2, tokens >= the largest chunk count and repeats >= 2")
    if args.compiled and args.dtype != "float32":
        parser.error("--compiled times fp32 chunks only (--dtype float32): see the module docstring")
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(1)
    # the fp32-output GEMM of CUDA, stood in by one call (no CPU kernel has it)
    grads._fp32_out_addmm = lambda acc, a, b: acc.add_(1.0) is acc
    torch._inductor.config.cpp.enable_kernel_profile = True  # generated kernels appear in the profile (launches)
    torch.manual_seed(0)
    mlp = transformers.models.llama.modeling_llama.LlamaMLP(
        transformers.LlamaConfig(hidden_size=32, intermediate_size=64)).to(dtype)
    x = torch.randn(1, args.tokens, 32, dtype=dtype, requires_grad=True)
    params = list(mlp.parameters())
    compiled_body = torch.compile(module_forward, dynamic=False, fullgraph=True)
    cases = {}
    for n in args.chunks:
        chunk = -(-args.tokens // n)
        cases[f"mini-sequence Function, {n} chunks"] = lambda chunk=chunk: mini_sequence_mlp(mlp, x, chunk)
        if args.compiled:
            cases[f"compiled chunk bodies, {n} chunks"] = (
                lambda chunk=chunk: chunked_function(compiled_body, mlp, x, chunk, params))
    cases["checkpointed, unsplit"] = lambda: torch.utils.checkpoint.checkpoint(mlp, x, use_reentrant=False)
    cases["plain, unsplit"] = lambda: mlp(x)
    first = {}
    for name, forward in cases.items():
        start = time.perf_counter()
        forward().sum().backward()
        first[name] = time.perf_counter() - start
    times = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, forward in cases.items():
            start = time.perf_counter()
            forward().sum().backward()
            times[name].append(time.perf_counter() - start)
    counts = {name: launches(lambda forward=forward: forward().sum().backward()) for name, forward in cases.items()}
    print(f"{args.dtype} LlamaMLP d=32 I=64, {args.tokens} tokens, forward + backward, 1 thread, torch "
          f"{torch.__version__}, transformers {transformers.__version__}; median of {args.repeats - args.repeats // 8} "
          f"after a warm-up; launches per call; first call's time")
    for name, measured in times.items():
        print(f"{name:40s} {statistics.median(measured[args.repeats // 8:]) * 1e3:8.3f} ms {counts[name]:6d} "
              f"launches {first[name] * 1e3:9.1f} ms first")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

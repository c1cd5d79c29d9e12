"""What compiled chunk bodies would give the streamed layer's host work: a probe of one design, not a supported path.

    python scripts/streamed_compile_probe.py [--policy cpu|cuda] [--repeats 9] [--layers 16]

host_cost.py's narrow stack (d=32, 512 tokens, fp32, one thread; `--policy`: the chunk counts "auto" gives Llama-3.2-1B
at 16K on that device type), trained by `streaming` with each chunk's call of the decoder layer's forward
(streaming_backward/layer.py `StreamedCall.call`) compiled by `torch.compile` (inductor, automatic dynamic shapes), as
the lever "fewer operators per chunk" proposes. Dynamo traces the layer's forward only with these changes, made here
by patching this process's classes; a supported path would need each as a design of its own:

- the cache's `update` left to eager (`torch.compiler.disable`): a chunk's layer runs as two graphs, before the cache
  and after it (there its K/V meet the K/V buffers and the row-block sums, Python objects dynamo does not trace);
- every chunk attends with a float mask (masks.OffsetChunkMasks, copied contiguous: a view's storage offset is a
  guard), not torch's lower-right causal bias, which dynamo does not trace; on a GPU that mask costs SDPA its
  FlashAttention kernel;
- no recorded K/V projections and no skipped query projection in the backward's K/V pass (each swaps a module's
  `forward`, which is guarded): q_proj, k_proj and v_proj see each token three times a step, not twice;
- no note of the modules a call ran (wrappers.noting_uncalled_parameters registers a global forward pre-hook per
  call: a new hook id per call is a guard that fails every time);
- dynamo's `allow_unspec_int_on_nn_module` (else the layer index the attention hands the cache compiles a graph per
  layer) and a cache limit of 64 graphs per function.

Rows: checkpointing; `streaming` as the distribution runs it; `streaming` with the changes above, eager (the
compiled row's own baseline); and compiled. `launches`: mlp_host_cost.py's count (torch.profiler: aten operators that
call no other, views included, and inductor's generated kernels); step time: medians of interleaved steps after
warm-up steps (the compiled model's first step, compilation included, printed apart); graphs: those dynamo made, and
how many more during the timed steps (0: no recompilation)."""

import argparse
import contextlib
import inspect
import statistics
import time

import torch
import torch._dynamo
import torch._inductor.config
from torch._dynamo.utils import counters

import host_cost
from mlp_host_cost import launches
from transformers.streaming_backward import cache as cache_module
from transformers.streaming_backward import layer as layer_module


_COMPILED = {}  # the layer class's forward -> its compiled version (one per class, shared by the layers)


@contextlib.contextmanager
def probe_changes(compiled: bool):
    """The changes of the module docstring while active, with the chunk bodies compiled or not."""
    original_init, update = layer_module.StreamedCall.__init__, cache_module._ChunkCache.update
    record, note = layer_module.skip_and_record_projections, layer_module.noting_uncalled_parameters

    def init(self, forward, *args, **kwargs):
        original_init(self, forward, *args, **kwargs)
        self.causal_bias, self.keys_dtype = False, torch.float32  # every chunk an OffsetChunkMasks view
        if compiled:
            if forward not in _COMPILED:
                _COMPILED[forward] = torch.compile(inspect.unwrap(forward))
            body = _COMPILED[forward]

            def contiguous_mask(layer, x, **kw):
                if kw.get(self.mask_name) is not None:
                    kw[self.mask_name] = kw[self.mask_name].contiguous()
                return body(layer, x, **kw)

            self.forward = contiguous_mask

    layer_module.StreamedCall.__init__ = init
    cache_module._ChunkCache.update = torch.compiler.disable(update)
    layer_module.skip_and_record_projections = lambda streamed, layer: None
    layer_module.noting_uncalled_parameters = lambda layer, found: contextlib.nullcontext()
    try:
        with torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True, cache_size_limit=64):
            yield
    finally:
        layer_module.StreamedCall.__init__, cache_module._ChunkCache.update = original_init, update
        layer_module.skip_and_record_projections, layer_module.noting_uncalled_parameters = record, note


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", choices=host_cost.POLICIES, default="cpu")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--layers", type=int, default=host_cost.SHAPE["num_hidden_layers"])
    parser.add_argument("--seq", type=int, default=host_cost.SEQ_LEN)
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.layers < 1 or args.seq < 2:
        parser.error("need --repeats >= 1, --layers >= 1 and --seq >= 2")
    torch.set_num_threads(1)
    torch._inductor.config.cpp.enable_kernel_profile = True  # generated kernels appear in the profile (launches)
    shape = dict(num_hidden_layers=args.layers)
    # name -> (method, the probe's changes: None, or whether compiled)
    cases = {"checkpointing": ("checkpointing", None), "streaming": ("streaming", None),
             "streaming, probe's changes, eager": ("streaming", False),
             "streaming, probe's changes, compiled": ("streaming", True)}
    models = {name: host_cost.build(method, seq_len=args.seq, shape=shape, policy=args.policy)
              for name, (method, _) in cases.items()}

    def step(name):
        changes = cases[name][1]
        with contextlib.nullcontext() if changes is None else probe_changes(changes):
            host_cost.step(*models[name])

    first = {}
    for name in cases:
        start = time.perf_counter()
        step(name)
        first[name] = time.perf_counter() - start
        step(name)
    graphs = counters["stats"]["unique_graphs"]
    times = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name in cases:
            start = time.perf_counter()
            step(name)
            times[name].append(time.perf_counter() - start)
    recompiled = counters["stats"]["unique_graphs"] - graphs
    counted = {name: launches(lambda name=name: step(name)) for name in cases}
    median = {name: statistics.median(measured) for name, measured in times.items()}
    mlp_chunks, streamed_chunks = host_cost.chunk_counts(args.policy)
    print(f"{args.layers} layers, {args.seq} tokens, {args.policy} auto chunk counts ({mlp_chunks} MLP, "
          f"{streamed_chunks} streamed); medians of {args.repeats} interleaved steps; graphs: {graphs} "
          f"({recompiled} more during the timed steps)")
    print("| case | launches | vs checkpointing | ms per step | vs checkpointing | first step s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in cases:
        print(f"| {name} | {counted[name]} | {counted[name] / counted['checkpointing']:.2f}x | "
              f"{median[name] * 1e3:.1f} | {median[name] / median['checkpointing']:.3f}x | {first[name]:.2f} |")


if __name__ == "__main__":
    main()

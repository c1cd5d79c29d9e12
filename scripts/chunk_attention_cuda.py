"""A streamed layer's attention per query chunk against the unsplit causal attention, kernel by kernel, on a GPU.

    python scripts/chunk_attention_cuda.py [--seq 16384] [--chunk 4096] [--json FILE]

On an H200 (docs/cuda/README.md, mst.39) a streamed Llama-3.2-1B step at 16K spent 271 ms in torch's FlashAttention-2
kernels (`_flash_attention_forward` / `_backward`, which torch's lower-right `CausalBias` dispatches to), where the
checkpointed step's causal attention over the same keys ran cuDNN's kernels in 191 ms. This times, for one layer's
shapes (Llama-3.2-1B: 32 query heads, 8 key/value heads of 64, bf16, batch 1), forward + backward of:

- `unsplit`: SDPA over the whole sequence, `is_causal=True`, `enable_gqa=True` (what checkpointing runs), and the
  same forced to each backend;
- `chunks_lower_right`: per query chunk, the keys up to its end repeated per head (upstream's `repeat_kv` when a mask
  is passed) and torch's `causal_lower_right` bias (what the streamed layer runs on a GPU today);
- `chunks_split`: per query chunk, the keys before it without a mask and its own keys with `is_causal=True` (a
  square), each an SDPA call with `enable_gqa=True` and the backend SDPA picks (the split `OwnKeysCausalBias` does on
  the CPU, streaming_backward/masks.py; the merge by log-sum-exp not included: a few elementwise kernels);
- whether cuDNN's causal attention aligns a non-square chunk bottom-right (checked against `causal_lower_right`).

Each time: CUDA events around 10 repetitions after 3 warm-ups, median of 3 such rounds, in ms.
"""

import argparse
import contextlib
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 64


def timed(fn, repeats=10, rounds=3):
    for _ in range(3):
        fn()
    results = []
    for _ in range(rounds):
        if not torch.cuda.is_available():  # a CPU smoke run of this script
            start = time.perf_counter()
            for _ in range(repeats):
                fn()
            results.append((time.perf_counter() - start) * 1e3 / repeats)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        torch.cuda.synchronize()
        results.append(start.elapsed_time(end) / repeats)
    return statistics.median(results)


def fwd_bwd(attend, q, k, v):
    def run():
        q_, k_, v_ = (t.detach().requires_grad_() for t in (q, k, v))
        out = attend(q_, k_, v_)
        out.backward(torch.ones_like(out))
    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--chunk", type=int, default=4096)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.manual_seed(0)
    cuda = torch.cuda.is_available()  # on a CPU: a smoke run (--seq 256 --chunk 64)
    shape = dict(device="cuda" if cuda else "cpu", dtype=torch.bfloat16 if cuda else torch.float32)
    q = torch.randn(1, HEADS, args.seq, HEAD_DIM, **shape)
    k = torch.randn(1, KV_HEADS, args.seq, HEAD_DIM, **shape)
    v = torch.randn(1, KV_HEADS, args.seq, HEAD_DIM, **shape)
    reps = HEADS // KV_HEADS
    bounds = [(s, min(s + args.chunk, args.seq)) for s in range(0, args.seq, args.chunk)]
    report = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__, "seq": args.seq,
              "chunk": args.chunk, "ms": {}, "errors": {}}

    def unsplit(q_, k_, v_):
        return F.scaled_dot_product_attention(q_, k_, v_, is_causal=True, enable_gqa=True)

    def chunks_lower_right(q_, k_, v_):
        outs = []
        for s, e in bounds:
            kr, vr = k_[:, :, :e].repeat_interleave(reps, 1), v_[:, :, :e].repeat_interleave(reps, 1)
            outs.append(F.scaled_dot_product_attention(q_[:, :, s:e], kr, vr, attn_mask=causal_lower_right(e - s, e)))
        return torch.cat(outs, 2)

    def chunks_split(q_, k_, v_):  # the two parts' outputs summed as a stand-in for their merge
        outs = []
        for s, e in bounds:
            own = F.scaled_dot_product_attention(q_[:, :, s:e], k_[:, :, s:e], v_[:, :, s:e], is_causal=True,
                                                 enable_gqa=True)
            if s:
                own = own + F.scaled_dot_product_attention(q_[:, :, s:e], k_[:, :, :s], v_[:, :, :s], enable_gqa=True)
            outs.append(own)
        return torch.cat(outs, 2)

    def record(label, measure, backends=None):  # an error is recorded and the other cases still run
        try:
            with sdpa_kernel(backends) if backends else contextlib.nullcontext():
                measure()
        except Exception as err:
            report["errors"][label] = f"{type(err).__name__}: {err}"[:500]

    def time_case(label, attend, *tensors):
        report["ms"][label] = timed(fwd_bwd(attend, *tensors))

    for name, attend in (("unsplit", unsplit), ("chunks_lower_right", chunks_lower_right), ("chunks_split", chunks_split)):
        record(name, lambda: time_case(name, attend, q, k, v))
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        for name, attend in (("unsplit", unsplit), ("chunks_split", chunks_split)):
            label = f"{name}[{backend.name}]"
            record(label, lambda: time_case(label, attend, q, k, v), [backend])
    # cuDNN's is_causal on a chunk after the first: aligned bottom-right (usable as is) or top-left?
    s, e = bounds[-1]
    kr, vr = k[:, :, :e].repeat_interleave(reps, 1), v[:, :, :e].repeat_interleave(reps, 1)
    with sdpa_kernel([SDPBackend.MATH]):
        reference = F.scaled_dot_product_attention(q[:, :, s:e].float(), kr.float(), vr.float(),
                                                   attn_mask=causal_lower_right(e - s, e))

    def cudnn_is_causal():
        got = F.scaled_dot_product_attention(q[:, :, s:e], kr, vr, is_causal=True)
        report["cudnn_is_causal_last_chunk_max_err_vs_lower_right"] = (got.float() - reference).abs().max().item()
        time_case("cudnn_is_causal_last_chunk_fwd_bwd",
                  lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True), q[:, :, s:e], kr, vr)

    record("cudnn_is_causal_last_chunk", cudnn_is_causal, [SDPBackend.CUDNN_ATTENTION])
    print(json.dumps(report, indent=1), flush=True)
    if args.json:
        with open(args.json, "w") as file:
            json.dump(report, file, indent=1)


if __name__ == "__main__":
    main()

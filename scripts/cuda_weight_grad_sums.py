"""How to sum a weight gradient over mini-sequences on a GPU: time of one chunk's contribution, per method.

    python scripts/cuda_weight_grad_sums.py [--tokens 2048] [--repeats 50]

For a bf16 weight [out, in] and a chunk of C tokens (grad_out [C, out], inputs [C, in]):
  bf16 mm            ``grad_out.T @ inputs`` in bf16 alone (what autograd computes per chunk; the unsplit
                     step does it once over all tokens)
  bf16 mm + fp32 add that product added into an fp32 accumulator (the mini-sequence paths' running sum)
  fp32-out addmm     ``torch.addmm(acc, grad_out.T, inputs, out_dtype=torch.float32, out=acc)``: one GEMM that
                     accumulates into the fp32 accumulator (no half-precision product at all)
Shapes: Llama-3.2-1B's MLP (2048 <-> 8192) and LM head (128256 x 2048), Llama-3-8B's LM head (128256 x 4096).
Errors: the accumulator after 4 chunks against an fp64 sum, relative (max abs / max abs). CUDA only.
"""

import argparse

import torch


def timed(fn, repeats):
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args(argv)
    gen = torch.Generator("cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, chunk of {args.tokens} tokens; ms per chunk")
    for name, (out_features, in_features) in {"mlp up/gate 8192x2048": (8192, 2048), "mlp down 2048x8192": (2048, 8192),
                                              "lm head 128256x2048": (128256, 2048),
                                              "lm head 128256x4096": (128256, 4096)}.items():
        grad_out = torch.randn(args.tokens, out_features, device="cuda", generator=gen).bfloat16()
        inputs = torch.randn(args.tokens, in_features, device="cuda", generator=gen).bfloat16()
        acc = torch.zeros(out_features, in_features, device="cuda")
        t_mm = timed(lambda: grad_out.T @ inputs, args.repeats)
        t_add = timed(lambda: acc.add_(grad_out.T @ inputs), args.repeats)
        t_fused = timed(lambda: torch.addmm(acc, grad_out.T, inputs, out_dtype=torch.float32, out=acc), args.repeats)
        exact = (grad_out.T.double() @ inputs.double()) * 4
        errors = {}
        for method in ("add", "fused"):
            acc.zero_()
            for _ in range(4):
                if method == "add":
                    acc.add_(grad_out.T @ inputs)
                else:
                    torch.addmm(acc, grad_out.T, inputs, out_dtype=torch.float32, out=acc)
            errors[method] = ((acc.double() - exact).abs().max() / exact.abs().max()).item()
        print(f"{name:22s} bf16 mm {t_mm:.3f}  bf16 mm + fp32 add {t_add:.3f}  fp32-out addmm {t_fused:.3f}  "
              f"(x{t_fused / t_add:.2f});  error after 4 chunks: add {errors['add']:.1e}, fused {errors['fused']:.1e}",
              flush=True)
        grad_out = inputs = acc = exact = None  # freed before the next shape (the lambdas above read them)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

"""The hybrids on a GPU (docs/cuda/README.md): streamed recurrent layers through upstream's fused kernels, where
`flash-linear-attention` is installed (upstream then runs its `chunk_gated_delta_rule` / `chunk_kda` Triton kernels
instead of the reference PyTorch scans; `--require-fla` refuses to run without them).

Part 1, exactness (`--exactness`): Qwen3.5 text (Gated DeltaNet + attention) and Kimi-Linear (Kimi Delta Attention +
MLA), d = 1024, 4 layers, batch 2, 4096 tokens, the second row left-padded by 300 and a tenth of the labels ignored.
Against the fp32 unsplit step: upstream's bf16 step and ours (both fields, chunks of 1000: five chunks, the last of
96) in bf16; and ours in fp32. The error is the largest relative L2 error over the parameters' gradients; a parameter
left without a gradient is counted and fails the run.

Part 2, steps (`--seq`): Qwen3.5 text at Qwen3.5-9B's widths (upstream's Qwen3_5TextConfig defaults: d = 4096,
V = 248320), 8 layers (3 Gated DeltaNet to 1 attention), bf16, batch 1, forward + backward (no optimizer). Peak =
`torch.cuda.max_memory_allocated` above the weights; time = median of `--repeats` steps after one warm-up step.
Methods: `checkpointing` (`activation_checkpointing_enable()`, the fields unset), `mini_sequence+checkpointing` and
`mini_sequence+streaming` ("auto" for each field set). An out-of-memory step is recorded as such.
"""

import argparse
import inspect
import json
import statistics
import time

import torch

import transformers

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: part 1 as a smoke run (tests/test_cuda_check.py)


def fla_kernels():
    """Which of upstream's scans run fused kernels here: the functions its modeling modules resolved at import."""
    from transformers.models.kimi_linear import modeling_kimi_linear as kimi
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    def origin(function):  # upstream's wrapper keeps the implementation it resolved as a closure variable
        implementation = inspect.getclosurevars(function).nonlocals.get("implementation", function)
        return f"{implementation.__module__}.{implementation.__qualname__}"

    found = {}
    for name, module in (("qwen3_5.chunk_gated_delta_rule", qwen), ("kimi_linear.chunk_kda", kimi)):
        function = next((getattr(module, n) for n in ("torch_chunk_gated_delta_rule", "chunk_gated_delta_rule",
                                                       "chunk_kimi_delta_attention") if hasattr(module, n)), None)
        found[name] = origin(function) if function is not None else "not found"
    try:
        import fla

        found["fla"] = fla.__version__
    except ImportError:
        found["fla"] = None
    return found


HIDDEN = 1024  # part 1's width (--hidden: tests/test_cuda_check.py runs part 1 narrower on the CPU)


def qwen3_5(**fields):
    sizes = dict(hidden_size=HIDDEN, intermediate_size=3 * HIDDEN, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=128, linear_num_key_heads=8, linear_num_value_heads=16,
                 vocab_size=32000, layer_types=["linear_attention"] * 3 + ["full_attention"])
    return transformers.Qwen3_5ForCausalLM, transformers.Qwen3_5TextConfig(**{**sizes, **fields})


def kimi_linear(**fields):
    sizes = dict(hidden_size=HIDDEN, intermediate_size=3 * HIDDEN, moe_intermediate_size=HIDDEN // 2,
                 num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=8, linear_num_heads=8, linear_head_dim=128,
                 kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, num_experts=8,
                 num_experts_per_token=2, vocab_size=32000, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                 layer_types=["linear_attention"] * 3 + ["full_attention"], mlp_layer_types=["dense"] + ["sparse"] * 3)
    return transformers.KimiLinearForCausalLM, transformers.KimiLinearConfig(**{**sizes, **fields})


def build(factory, dtype, seed=0, checkpointing=False, **fields):
    model_class, config = factory(attn_implementation="sdpa", use_cache=False, **fields)
    torch.manual_seed(seed)
    model = model_class(config).to(device=DEVICE, dtype=dtype).train()
    if checkpointing:
        model.activation_checkpointing_enable()
    return model


def gradients(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    grads = {n: None if p.grad is None else p.grad.double() for n, p in model.named_parameters()}
    return loss.double().item(), grads


def error(grads, reference):
    missing = [n for n, g in grads.items() if g is None and reference[n] is not None]
    errors = {n: ((g - reference[n]).norm() / reference[n].norm().clamp_min(1e-30)).item()
              for n, g in grads.items() if g is not None and reference[n] is not None}
    worst = max(errors, key=errors.get)
    return errors[worst], worst, missing


def exactness(name, factory, seq, chunk=1000):
    torch.manual_seed(1)
    ids = torch.randint(3, 32000, (2, seq), device=DEVICE)
    mask = torch.ones_like(ids)
    mask[1, : seq // 13] = 0
    labels = ids.masked_fill(mask == 0, -100).masked_fill(torch.rand(ids.shape, device=DEVICE) < 0.1, -100)
    batch = dict(input_ids=ids, attention_mask=mask, labels=labels)
    fields = dict(streaming_backward_chunk=chunk, mini_sequence_chunk=chunk)
    ref_loss, reference = gradients(build(factory, torch.float32), batch)
    report = {}
    for label, dtype, extra in (("upstream_bf16", torch.bfloat16, {}), ("ours_bf16", torch.bfloat16, fields),
                                ("ours_fp32", torch.float32, fields)):
        loss, grads = gradients(build(factory, dtype, **extra), batch)
        worst, where, missing = error(grads, reference)
        report[label] = dict(loss_relative_error=abs(loss - ref_loss) / abs(ref_loss), gradient_error=worst,
                             largest_error_at=where, parameters_without_gradient=missing)
        print(f"{name} {label}: loss error {report[label]['loss_relative_error']:.2e}, largest gradient error "
              f"{worst:.2e} ({where}), without gradient {len(missing)}", flush=True)
    return report


def nine_b_widths(layers=8):
    def factory(**fields):
        return transformers.Qwen3_5ForCausalLM, transformers.Qwen3_5TextConfig(
            num_hidden_layers=layers, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (layers // 4),
            **fields)
    return factory


METHODS = {"checkpointing": dict(checkpointing=True),
           "mini_sequence+checkpointing": dict(checkpointing=True, mini_sequence_chunk="auto"),
           "mini_sequence+streaming": dict(mini_sequence_chunk="auto", streaming_backward_chunk="auto")}


def steps(seqs, methods, repeats):
    rows = []
    for method in methods:
        model = build(nine_b_widths(), torch.bfloat16, **METHODS[method])
        weights = torch.cuda.memory_allocated()
        for seq in seqs:
            ids = torch.randint(0, model.config.vocab_size, (1, seq), device=DEVICE)
            row = dict(method=method, seq=seq, weights_GiB=weights / 2**30)
            try:
                times = []
                torch.cuda.reset_peak_memory_stats()
                for index in range(repeats + 1):
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    model(input_ids=ids, labels=ids).loss.backward()
                    model.zero_grad(set_to_none=True)
                    torch.cuda.synchronize()
                    if index:
                        times.append(time.perf_counter() - start)
                    else:
                        row["first_step_s"] = time.perf_counter() - start
                row.update(step_s=statistics.median(times),
                           peak_above_weights_GiB=(torch.cuda.max_memory_allocated() - weights) / 2**30)
            except torch.OutOfMemoryError:
                row["out_of_memory"] = True
                model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            rows.append(row)
            print(json.dumps(row), flush=True)
        del model
        torch.cuda.empty_cache()
    return rows


def main():
    global HIDDEN
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--exactness", action="store_true")
    parser.add_argument("--exactness-seq", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=HIDDEN, help="part 1's hidden size")
    parser.add_argument("--seq", type=int, nargs="*", default=[])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--require-fla", action="store_true")
    parser.add_argument("--no-tf32", action="store_true", help="cuDNN's fp32 convolutions without TF32 (on by "
                        "default in torch: upstream's short convolutions run as conv1d without `causal_conv1d`)")
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    HIDDEN = args.hidden
    if args.no_tf32:
        torch.backends.cudnn.allow_tf32 = False
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    report = dict(cudnn_allow_tf32=torch.backends.cudnn.allow_tf32, device=device, torch=torch.__version__,
                  transformers=transformers.__version__, kernels=fla_kernels())
    print(json.dumps(report), flush=True)
    if args.require_fla and not report["kernels"]["fla"]:
        raise SystemExit("flash-linear-attention is not importable here: upstream would run its reference scans")
    if args.exactness:
        chunk = min(1000, args.exactness_seq // 4)
        report["exactness"] = {name: exactness(name, factory, args.exactness_seq, chunk)
                               for name, factory in (("qwen3_5_text", qwen3_5), ("kimi_linear", kimi_linear))}
    if args.seq:
        report["steps"] = steps(args.seq, args.methods, args.repeats)
    with open(args.json, "w") as file:
        json.dump(report, file, indent=1)
    missing = [(name, label) for name, rows in report.get("exactness", {}).items() for label, row in rows.items()
               if row["parameters_without_gradient"]]
    if missing:
        raise SystemExit(f"parameters without a gradient: {missing}")


if __name__ == "__main__":
    main()

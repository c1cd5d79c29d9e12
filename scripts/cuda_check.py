"""CUDA measurements of every method on one GPU (run where a GPU is lent; CPU for a smoke run).

    python scripts/cuda_check.py [--model llama-1b] [--seq 4096 16384] [--methods ...] [--out DIR]
    python scripts/cuda_check.py --planner-only [--seq ...] [--out DIR]   # on a CPU: the planner's estimates

Four parts, each printing its numbers and writing them to <out>/cuda_check_<seqs>.json:

1. exactness on CUDA: a small fp32 Llama, flag off vs chunks 7, 64 and "auto", batch 2 with left
   padding and ignored labels: loss and every gradient (relative error, must be <= 1e-5);
   and the same with the LM head on the CPU and the rest on the GPU (accelerate `device_map`
   hooks: the wrapped path, labels moved to the head's device as upstream does); and Llama-3.2-1B's
   MLP in bf16 by mini-sequences against fp64, as accurate as upstream bf16 (`mlp_bf16_accuracy`).
2. training steps of a ~1.2B Llama (Llama-3.2-1B shapes, bf16 weights and AdamW states in bf16,
   SDPA attention) for each method of `METHODS` (vanilla, checkpointing, mini_sequence,
   mini_sequence+checkpointing, streaming, mini_sequence+streaming, the same with offloaded layer
   inputs, and compiled steps with the flag off and on) at each --seq: peak
   `torch.cuda.max_memory_allocated` (weights, optimizer states, gradients, activations) and median
   step time (forward, backward, AdamW).
3. streaming backward (`streaming_backward_chunk`) on CUDA, for sdpa and, where flash-attn is installed,
   flash_attention_2: a small bf16 Llama (GQA), chunks 7 and 64, a left-padded batch and a packed one
   (restarting position_ids); every gradient's error against an fp32 unsplit sdpa run, next to upstream
   bf16's own error with the same attention (ours must be within 1.25x of it + 1e-3).
4. the planner's estimate of the same peaks (fake tensors on CPU, FlashAttention-like stand-in),
   next to the measurement: how far the planner is from a real GPU. `--planner-only` computes just
   these (no GPU needed), to be merged with a GPU run's file by `--merge-planner FILE`.
"""

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import policy_overrides
import torch
import transformers

# name -> (mini_sequence_chunk, checkpointing, streaming_backward_chunk, offloaded layer inputs, compiled)
METHODS = {
    "vanilla": (None, False, None, False, False),
    "checkpointing": (None, True, None, False, False),
    "mini_sequence": ("auto", False, None, False, False),
    "mini_sequence+checkpointing": ("auto", True, None, False, False),
    "streaming": (None, False, "auto", False, False),
    "mini_sequence+streaming": ("auto", False, "auto", False, False),
    # activation_checkpointing_enable(offload=True): the streamed layers keep their inputs in host memory
    "mini_sequence+streaming+offload": ("auto", True, "auto", True, False),
    "checkpointing+compile": (None, True, None, False, True),
    "mini_sequence+checkpointing+compile": ("auto", True, None, False, True),
    # the streamed layer as one custom operator in the compiled graph (streaming_backward/compiled.py)
    "streaming+compile": (None, False, "auto", False, True),
    "mini_sequence+streaming+compile": ("auto", False, "auto", False, True),
}
# The planner's method for each measured one (it plans no compiled step: same tensors, other kernels).
PLANNED_AS = {"mini_sequence+streaming+offload": "mini_sequence+streaming", "checkpointing+compile": "checkpointing",
              "mini_sequence+checkpointing+compile": "mini_sequence+checkpointing", "streaming+compile": "streaming",
              "mini_sequence+streaming+compile": "mini_sequence+streaming"}
MODELS = {
    # Llama-3.2-1B's public config.json shapes (tied embeddings).
    "llama-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0,
                     tie_word_embeddings=True),
    # for a CPU smoke run of this script
    "tiny": dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
}


def rel_err(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()


def exactness(device):
    """Flag off vs on, fp32, on `device`; and with the LM head on the CPU (device_map)."""
    from accelerate import dispatch_model

    config = dict(MODELS["tiny"], vocab_size=512, pad_token_id=0)
    gen = torch.Generator().manual_seed(1234)
    ids = torch.randint(1, 512, (2, 300), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :17] = 0
    labels = ids.clone()
    labels[mask == 0] = -100
    labels[0, 50:90] = -100

    def run(chunk, split_head):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config, mini_sequence_chunk=chunk))
        if split_head:
            # main_device="cpu": the head really lives on the CPU (otherwise accelerate treats CPU
            # modules as offloaded weights, loaded into the GPU at each call).
            model = dispatch_model(model, device_map={"model": device, "lm_head": "cpu"}, main_device="cpu")
        else:
            model.to(device)
        model.train()
        out = model(input_ids=ids.to(device), attention_mask=mask.to(device), labels=labels.to(device))
        out.loss.backward()
        grads = {n: p.grad.detach().cpu() for n, p in model.named_parameters() if p.grad is not None}
        missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
        return out.loss.detach().cpu(), grads, missing

    results = {}
    for split_head in (False, True) if device != "cpu" else (False,):
        ref_loss, ref_grads, _ = run(None, split_head)
        for chunk in (7, 64, "auto"):
            loss, grads, missing = run(chunk, split_head)
            name = f"chunk={chunk}" + (" lm_head on cpu" if split_head else "")
            worst = max(rel_err(grads[n], ref_grads[n]) for n in ref_grads)
            results[name] = {"loss_rel_err": rel_err(loss, ref_loss), "max_grad_rel_err": worst, "missing_grads": missing}
            print(f"exactness {name:28s} loss rel err {results[name]['loss_rel_err']:.1e}  "
                  f"max grad rel err {worst:.1e}  missing grads {missing}", flush=True)
    return results


def mlp_bf16_accuracy(device, model_name="llama-1b"):
    """The mini-sequence MLP in bf16 on `device` (`model_name`'s MLP on 2 x hidden_size tokens in chunks of hidden_size / 4:
    Llama-3.2-1B's by default, 4096 tokens, chunks of 512): relative-norm
    error of the output, the input gradient and each weight gradient against fp64 from the same bf16 values, next
    to upstream bf16's (ours must be within 1.25x of it + 1e-4). On CUDA the weight gradients are summed by
    fp32-output GEMMs (`mst_core/grads.py: LinearWeightGradsSummed`)."""
    import copy

    from transformers.mini_sequence.mlp import mini_sequence_mlp
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    with torch.device(device):
        mlp16 = LlamaMLP(transformers.LlamaConfig(**MODELS[model_name])).to(torch.bfloat16)
        x16 = torch.randn(1, 2 * mlp16.hidden_size, mlp16.hidden_size).bfloat16()
        g16 = torch.randn_like(x16)
    mlp64 = copy.deepcopy(mlp16).double()

    def run(mlp, x, g, chunk=None):
        x = x.detach().requires_grad_()
        out = mini_sequence_mlp(mlp, x, chunk) if chunk else mlp(x)
        return [out, *torch.autograd.grad(out, [x, *mlp.parameters()], g)]

    reference, upstream, ours = run(mlp64, x16.double(), g16.double()), run(mlp16, x16, g16), run(mlp16, x16, g16, mlp16.hidden_size // 4)
    results = {}
    names = ["output", "x grad", *(f"{n} grad" for n, _ in mlp16.named_parameters())]
    for name, got, up, ref in zip(names, ours, upstream, reference):
        err, err_up = [((t.double() - ref).norm() / ref.norm()).item() for t in (got, up)]
        results[name] = {"err": err, "upstream_err": err_up, "ok": err <= 1.25 * err_up + 1e-4}
        print(f"mlp bf16 {name:22s} error {err:.2e} (upstream bf16 {err_up:.2e})", flush=True)
    return results


def streaming_exactness(device):
    """Streaming backward vs unsplit, bf16 on `device`, both measured against an fp32 unsplit sdpa reference. The
    "autocast" batch: fp32 weights under bf16 autocast (the Trainer's `bf16=True`), no padding, so no attention mask
    (each chunk's lower-right causal bias; until mst.21 a dtype error)."""
    from transformers.utils import is_flash_attn_2_available

    config = dict(MODELS["tiny"], vocab_size=512, pad_token_id=0, sliding_window=None)
    gen = torch.Generator().manual_seed(99)
    ids = torch.randint(1, 512, (2, 300), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :40] = 0
    lengths = [120, 37, 143]
    batches = {
        "padded": dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)),
        "packed": dict(input_ids=ids[:1], labels=ids[:1],
                       position_ids=torch.cat([torch.arange(n) for n in lengths])[None]),
        "autocast": dict(input_ids=ids, labels=ids),
    }

    def grads_of(implementation, dtype, chunk, inputs):
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(**config, streaming_backward_chunk=chunk)
        model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation=implementation)
        autocast = inputs is batches["autocast"] and dtype == torch.bfloat16
        model.to(device=device, dtype=torch.float32 if autocast else dtype).train()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            model(**{k: v.to(device) for k, v in inputs.items()}).loss.backward()
        return torch.cat([p.grad.double().flatten().cpu() for p in model.parameters()])

    implementations = ["sdpa"] + (["flash_attention_2"] if device == "cuda" and is_flash_attn_2_available() else [])
    results = {}
    for kind, inputs in batches.items():
        reference = grads_of("sdpa", torch.float32, None, inputs)
        for implementation in implementations:
            upstream = ((grads_of(implementation, torch.bfloat16, None, inputs) - reference).norm() / reference.norm()).item()
            for chunk in (7, 64):
                ours = ((grads_of(implementation, torch.bfloat16, chunk, inputs) - reference).norm() / reference.norm()).item()
                name = f"{implementation} {kind} chunk={chunk}"
                results[name] = {"grad_err": ours, "upstream_grad_err": upstream, "ok": ours <= 1.25 * upstream + 1e-3}
                print(f"streaming {name:36s} grad err {ours:.2e} (upstream bf16 {upstream:.2e})", flush=True)
    if "flash_attention_2" not in implementations:
        print("streaming: flash_attention_2 not checked (flash-attn not installed or no GPU)", flush=True)
    return results


def build(model_name, method, device, streaming_chunk="auto"):
    chunk, checkpointing, streaming, offload, compiled = METHODS[method]
    streaming = streaming and streaming_chunk  # --streaming-chunk for the streamed methods
    config = transformers.LlamaConfig(**MODELS[model_name], mini_sequence_chunk=chunk,
                                      streaming_backward_chunk=streaming, use_cache=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):  # initialized where it runs: a 1.2B random init on the host takes seconds
        model = transformers.LlamaForCausalLM(config).to(dtype=torch.bfloat16)
    model.train()
    if checkpointing:
        model.activation_checkpointing_enable(offload=offload)
    if compiled:
        model.compile()
    return model


def train_steps(model_name, method, seq, device, repeats, streaming_chunk="auto"):
    model = build(model_name, method, device, streaming_chunk)
    # AdamW with bf16 states (the planner's adamw-bf16): states created by one step on zero grads.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=False)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    ids = torch.randint(0, MODELS[model_name]["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(seq))
    ids = ids.to(device)
    times, losses, loss = [], [], None
    compiled = METHODS[method][4]
    from torch._dynamo.utils import counters

    counters.clear()  # graphs compiled in this run: the model's (+compile) or the LM-head loss's kernels
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    try:
        for _ in range(repeats + 1):  # the first step warms up (and compiles)
            start = time.perf_counter()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            losses.append(loss.item())
            if len(times) == 1:
                graphs_after_first_step = counters["stats"]["unique_graphs"]
    except torch.OutOfMemoryError:
        return {"method": method, "seq": seq, "oom": True}
    finally:
        peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
        del model, optimizer, loss  # the loss's graph holds the parameters (its AccumulateGrad nodes)
        gc.collect()
        # what outlives the step's model (a compiled graph holding its weights would): counted by later rows' peaks
        left = torch.cuda.memory_allocated() if device == "cuda" else None
        if device == "cuda":
            torch.cuda.empty_cache()
    row = {"method": method, "seq": seq, "oom": False, "peak_bytes": peak, "allocated_after_bytes": left,
           "step_seconds": statistics.median(times[1:]), "first_loss": losses[0],
           # what a user waits for once (compilation), and whether a later step compiled again
           "first_step_seconds": times[0], "graphs_compiled": counters["stats"]["unique_graphs"],
           "graphs_compiled_after_first_step": counters["stats"]["unique_graphs"] - graphs_after_first_step}
    if compiled:  # graph breaks over the whole run (the warm-up step compiles; later steps reuse)
        row["graph_breaks"] = sum(counters["graph_break"].values())
    return row


def profile_step(model_name, method, seq, device, rows=25, streaming_chunk="auto"):
    """One step (after a warm-up) under torch.profiler: the ops taking the most device time and the most host
    time, and on CUDA every host-device synchronization (`torch.cuda.set_sync_debug_mode`), by call site."""
    import collections
    import traceback
    import warnings

    from torch.profiler import ProfilerActivity, profile, record_function

    model = build(model_name, method, device, streaming_chunk)
    ids = torch.randint(0, MODELS[model_name]["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(seq))
    ids = ids.to(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    syncs = collections.Counter()

    def record_sync(message, *args, **kwargs):
        frames = [f for f in traceback.extract_stack()[:-1] if "site-packages/torch/" not in f.filename]
        syncs[" <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in frames[-3:][::-1])] += 1

    for step in range(2):
        with profile(activities=activities) if step else contextlib.nullcontext() as prof, warnings.catch_warnings():
            if step and device == "cuda":
                warnings.simplefilter("always")
                warnings.showwarning = record_sync
                torch.cuda.set_sync_debug_mode("warn")
            with record_function("forward"):
                loss = model(input_ids=ids, labels=ids).loss
            with record_function("backward"):
                loss.backward()
            model.zero_grad(set_to_none=True)
            if device == "cuda":
                torch.cuda.set_sync_debug_mode("default")
                torch.cuda.synchronize()
    print(f"--- profile S={seq} {method}", flush=True)
    for sort in ("self_cuda_time_total",) * (device == "cuda") + ("self_cpu_time_total",):
        print(prof.key_averages().table(sort_by=sort, row_limit=rows, max_name_column_width=60), flush=True)
    print(f"host-device synchronizations: {sum(syncs.values())}", flush=True)
    for where, count in syncs.most_common(20):
        print(f"  {count:5d}  {where}", flush=True)
    del model


def planner_peaks(model_name, methods, seqs, streaming_chunk="auto"):
    """{(method, seq): planned peak bytes} for the measured methods (offloaded inputs planned as such)."""
    from transformers.mst_planner.plan import Parallel, Planner

    config = transformers.LlamaConfig(**MODELS[model_name])
    planners = {False: Planner(config, optimizer="adamw-bf16", streaming_chunk=streaming_chunk),
                True: Planner(config, optimizer="adamw-bf16", parallel=Parallel(offload=("inputs",)),
                              streaming_chunk=streaming_chunk)}
    return {(m, s): planners[METHODS[m][3]].peak_bytes(PLANNED_AS.get(m, m), s) for m in methods for s in seqs}


def print_row(row):
    if row["oom"]:
        print(f"S={row['seq']:6d} {row['method']:36s} OOM", flush=True)
        return
    peak, plan = row["peak_bytes"], row.get("planner_peak_bytes")
    print(f"S={row['seq']:6d} {row['method']:36s} peak {peak / 2**30 if peak else float('nan'):7.2f} GiB  "
          f"planner {plan / 2**30 if plan else float('nan'):7.2f} GiB  "
          f"step {row['step_seconds']:.3f} s  loss {row['first_loss']:.4f}"
          + (f"  graph breaks {row['graph_breaks']}" if "graph_breaks" in row else ""), flush=True)


def streaming_chunk_arg(value):
    """--streaming-chunk: "auto" or a positive int."""
    if value == "auto":
        return value
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f'{value!r}: allowed "auto" or a positive int (query tokens per chunk)')
    return int(value)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-1b", choices=list(MODELS))
    parser.add_argument("--seq", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--no-planner", action="store_true", help="skip the planner comparison")
    parser.add_argument("--planner-only", action="store_true", help="only part 4 (no GPU needed), written to "
                        "<out>/planner_<seqs>.json")
    parser.add_argument("--merge-planner", type=Path, help="a --planner-only file: its estimates are added to this "
                        "run's rows (with --no-planner on a GPU machine, the planner having run on a CPU one)")
    parser.add_argument("--profile", action="store_true", help="instead of the parts: profile one step of each "
                        "--methods at each --seq (torch.profiler's table of the ops taking the most time)")
    parser.add_argument("--no-exactness", action="store_true", help="skip part 1")
    parser.add_argument("--no-streaming", action="store_true", help="skip part 3")
    parser.add_argument("--streaming-chunk", type=streaming_chunk_arg, default="auto",
                        help='streaming_backward_chunk of the streamed methods: "auto" (default) or query tokens per '
                             "chunk (fewer, larger chunks: less host work per step for more memory)")
    parser.add_argument("--out", type=Path, default=Path("out/cuda_check"))
    policy_overrides.add_arguments(parser)
    args = parser.parse_args(argv)
    overrides = policy_overrides.apply(args)
    seqs = "_".join(map(str, args.seq))
    args.out.mkdir(parents=True, exist_ok=True)
    if args.planner_only:
        planned = planner_peaks(args.model, args.methods, args.seq, args.streaming_chunk)
        rows = [{"method": m, "seq": s, "planner_peak_bytes": b} for (m, s), b in planned.items()]
        for row in rows:
            print(f"S={row['seq']:6d} {row['method']:36s} planner {row['planner_peak_bytes'] / 2**30:7.2f} GiB", flush=True)
        (args.out / f"planner_{seqs}.json").write_text(json.dumps({"model": args.model, "transformers":
                                                                   transformers.__version__, "overrides": overrides,
                                                                   "rows": rows}, indent=1))
        return 0
    device = "cuda" if torch.cuda.is_available() else "cpu"
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"device {name}, torch {torch.__version__}, transformers {transformers.__version__}", flush=True)
    if args.profile:
        for seq in args.seq:
            for method in args.methods:
                profile_step(args.model, method, seq, device, streaming_chunk=args.streaming_chunk)
        return 0

    report = {"device": name, "torch": torch.__version__, "transformers": transformers.__version__,
              "model": args.model, "model_config": MODELS[args.model], "head": args.head,
              "streaming_chunk": args.streaming_chunk, "overrides": overrides}
    report["exactness"] = {} if args.no_exactness else exactness(device)
    report["mlp_bf16"] = {} if args.no_exactness else mlp_bf16_accuracy(device, args.model)
    report["streaming"] = {} if args.no_streaming else streaming_exactness(device)
    planned = {} if args.no_planner else planner_peaks(args.model, args.methods, args.seq, args.streaming_chunk)
    rows = []
    for seq in args.seq:
        for method in args.methods:
            try:
                row = train_steps(args.model, method, seq, device, args.repeats, args.streaming_chunk)
            except Exception as err:  # e.g. a compiler failure: recorded, the other methods still run
                print(f"S={seq:6d} {method:36s} FAILED: {type(err).__name__}: {err}"[:2000], flush=True)
                rows.append({"method": method, "seq": seq, "oom": False, "error": f"{type(err).__name__}: {err}"[:2000]})
                continue
            if (method, seq) in planned:
                row["planner_peak_bytes"] = planned[(method, seq)]
            rows.append(row)
            print_row(row)
            # after each row: a run stopped at its time limit keeps what it measured
            write_report(dict(report, steps=rows), args.out / f"cuda_check_{seqs}.json", args.merge_planner)
    report["steps"] = rows
    write_report(report, args.out / f"cuda_check_{seqs}.json", args.merge_planner)
    bad = [k for k, v in report["exactness"].items() if v["loss_rel_err"] > 1e-5 or v["max_grad_rel_err"] > 1e-5 or v["missing_grads"]]
    bad += [f"mlp bf16 {k}" for k, v in report["mlp_bf16"].items() if not v["ok"]]
    bad += [k for k, v in report["streaming"].items() if not v["ok"]]
    bad += [f"{r['method']} S={r['seq']}" for r in rows if "error" in r]
    if bad:
        print(f"NOT EXACT OR FAILED: {bad}", file=sys.stderr)
        return 1
    return 0


def write_report(report, path, planner_file=None):
    """Write `report` to `path`, first adding the estimates of a --planner-only file to its rows."""
    if planner_file is not None:
        planned = {(r["method"], r["seq"]): r["planner_peak_bytes"] for r in json.loads(planner_file.read_text())["rows"]}
        for row in report["steps"]:
            if (row["method"], row["seq"]) in planned:
                row["planner_peak_bytes"] = planned[(row["method"], row["seq"])]
    path.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    sys.exit(main())

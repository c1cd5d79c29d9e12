"""Memory and time of training with and without mini-sequences. The sweeps:

  methods   one model family, a sweep of sequence lengths S, the methods vanilla,
            checkpointing, mini_sequence, mini_sequence+checkpointing, streaming,
            mini_sequence+streaming: peak memory and step time of one full training step
            (forward, backward, AdamW step).
  blocks    the paper's App. F sweep (Tables 13-16): the MLP block and the LM-head + loss
            block alone, time and peak memory vs the number of mini-sequences M and S.
  families  the four families at one S, flag off vs on (issue-3 targets).
  streaming StreamBP's CPU targets: Gemma-2 peak vs flag off, activation memory
            vs mini_sequence+checkpointing at 32K (fp32, bf16), and a sweep of
            streaming_backward_chunk values (time and peak) at 8K/16K.
  host      host work per step (scripts/host_cost.py): aten operators dispatched, tokens through q_proj and
            gate_proj, and the host-bound step time of a narrow 16-layer Llama (d=32, 512 tokens), per
            method relative to checkpointing, with the chunk counts "auto" gives Llama-3.2-1B at 16K on the
            CPU (8 MLP, 8 streamed) and on an accelerator (4, 4), without and with a forward pre-hook on
            every module (as ZeRO-3).
  compile   torch.compile: per method, the graph breaks of a compiled training step (dynamo's
            counters), the compiled step time against the compiled flags-unset step, and the step's
            peak above its start, compiled and eager (CPU: torch.profiler's memory timeline, which
            sees inductor's buffers; the tensor tracker does not).
  mamba     adjoint sharding: Mamba, peak memory and step time vs S for upstream's torch
            path, upstream + checkpointing, adjoint (+ mini_sequence), adjoint + checkpointing,
            truncated adjoint; and a sweep of adjoint_sharding_chunk values at one S. Upstream's
            torch path is quadratic in time on CPU: above --upstream-max-seq its peak is measured
            under FakeTensorMode (shapes only, no data; checked against a real step at
            --fake-check-seq) and its time is not measured.

Peak memory: on CUDA `torch.cuda.max_memory_allocated` after `reset_peak_memory_stats`
(everything: weights, gradients, optimizer states, activations). On CPU the exact peak of
live tensor bytes (`LiveTensorTracker`, a TorchDispatchMode) during the step, plus the bytes
of the weights and optimizer states that existed before it: the same quantity as the CUDA
allocator's, without allocator rounding or caching. Step time: median of --repeats steps
after a warm-up, with the methods interleaved so that machine noise hits them alike.

Each sweep writes <out>/<sweep>.csv and .md and PNG plots (matplotlib) and prints the table.
<out> is out/bench/ by default (ignored by git, so a run leaves the checkout clean); the
results committed under docs/bench/ are written on purpose with --out docs/bench (or
`make bench OUT=docs`).
"""

import argparse
import csv
import itertools
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.profiler import ProfilerActivity, profile
from tqdm import tqdm

import host_cost
import hybrid_bench
import transformers
from transformers.adjoint_sharding import shard_tokens
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.mini_sequence import mini_sequence_causal_lm_loss, mini_sequence_mlp
from transformers.mst_core.families import FAMILIES as REGISTRY
from transformers.mst_core.memory import LiveTensorTracker, resident_training_bytes
from transformers.mst_planner.plan import METHODS, Method  # name -> (mini_sequence_chunk, checkpointing, streaming)

_ROUTED = {"n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 256, "n_shared_experts": 1,
           "n_group": 2, "topk_group": 1}
# Gated DeltaNet layers (Qwen3.5, Qwen3-Next): heads of 64 (2 for keys, 4 for values), one linear-attention and one
# full-attention layer; with MoE blocks of 8 experts of 256 (top 2) and a gated shared expert of 256.
_LINEAR = {"head_dim": 64, "linear_key_head_dim": 64, "linear_value_head_dim": 64, "linear_num_key_heads": 2,
           "linear_num_value_heads": 4, "layer_types": ["linear_attention", "full_attention"]}
_LINEAR_MOE = {**_LINEAR, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 256,
               "shared_expert_intermediate_size": 256}
_INDEXER = {"q_lora_rank": 128, "mlp_layer_types": ["dense", "sparse"], "index_topk": 2048, "index_head_dim": 64,
            "index_n_heads": 4}
_LATENT = {"kv_lora_rank": 128, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64}
# Per family: overrides of BASE (class names: the registry, transformers/mst_core/families.py).
FAMILIES = {
    "llama": {},
    "qwen2": {},
    "mistral": {"sliding_window": None},
    # Gemma-2 has no SDPA path upstream (softcapped attention) and flex attention has no CPU
    # backward: on CPU it runs eager attention, whose [heads, S, S] scores are in its peak.
    "gemma2": {"head_dim": 64},
    # The newer families (`families` sweep): q/k norms, fused projections, windows, MoE blocks (8 experts, top 2).
    "qwen3": {"head_dim": 64},
    # Their default pad/eos ids (32000, 50279) are outside BASE's vocabulary.
    "phi3": {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    "olmo2": {"eos_token_id": 2},
    "gemma3_text": {"head_dim": 64, "sliding_window": 512},
    # Qwen3.5 text: Gated DeltaNet linear-attention layers (upstream's reference PyTorch path on a CPU) and a
    # full-attention one; linear-attention heads of 64 (2 for keys, 4 for values).
    "qwen3_5_text": _LINEAR,
    "olmo3": {"eos_token_id": 2, "sliding_window": 512},
    "smollm3": {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    "ministral3": {},
    # Granite 3.x: muP multipliers, logits divided by IBM's 3.x scale of 8.
    "granite": {"embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.015625,
                "logits_scaling": 8.0},
    # Gemma-4 text: per-layer inputs of 64 (their vocabulary BASE's), full-attention heads of 64, sliding windows.
    "gemma4_text": {"head_dim": 64, "global_head_dim": 64, "sliding_window": 512, "hidden_size_per_layer_input": 64,
                    "vocab_size_per_layer_input": 32000},
    # Qwen3.5-MoE text: Qwen3.5 text's layers with a MoE block (8 experts, top 2, a gated shared expert) in each.
    "qwen3_5_moe_text": _LINEAR_MOE,
    # Qwen3-Next: the same layers and MoE blocks (Qwen3.5-MoE's forerunner).
    "qwen3_next": _LINEAR_MOE,
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": None},
    # OLMoE: Mixtral-style experts (8, top 2) of BASE's MLP size. DeepSeek-V2/V3 and the GLM MoE ones: layer 0 dense,
    # layer 1 with 8 routed experts (top 2, in 2 groups) of 256 and a shared one; latent attention (DeepSeek-V2/V3,
    # GLM-4.7-Flash) with heads of 64 + 32 rotary dims and latents of 128.
    "olmoe": {"eos_token_id": 2, "num_experts": 8, "num_experts_per_tok": 2},
    "deepseek_v2": {**_ROUTED, **_LATENT, "first_k_dense_replace": 1, "q_lora_rank": None},
    "deepseek_v3": {**_ROUTED, **_LATENT, "first_k_dense_replace": 1, "q_lora_rank": 128},
    "glm4_moe": {**_ROUTED, "head_dim": 64, "first_k_dense_replace": 1},
    "glm4_moe_lite": {**_ROUTED, **_LATENT, "q_lora_rank": 128, "mlp_layer_types": ["dense", "sparse"]},
    # DeepSeek-V3.2 and GLM-5: GLM-4.7-Flash's layers with DeepSeek Sparse Attention (an indexer of 4 heads of 64
    # keeping each query's 2048 best keys).
    "deepseek_v32": {**_ROUTED, **_LATENT, **_INDEXER},
    "glm_moe_dsa": {**_ROUTED, **_LATENT, **_INDEXER},
    # Llama-4 text: a MoE block in every layer (Scout's layout) whose 8 experts of 256 see every token, scaled by its
    # top-1 router score, beside a shared expert of 256; chunked attention (chunks of 1024) on its rotary layers.
    "llama4_text": {"head_dim": 64, "num_local_experts": 8, "intermediate_size": 256, "attention_chunk_size": 1024},
    "qwen3_moe": {"head_dim": 64, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 256},
    "gpt_oss": {"head_dim": 64, "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": 512},
}
# Llama-style small config: big vocabulary and MLP relative to d, as in real models.
BASE = dict(hidden_size=256, intermediate_size=1024, vocab_size=32000, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1 << 17)
MIB = 2**20
STREAMING_PARTS = ("gemma2", "activation", "chunks")
MAMBA_PARTS = ("methods", "shards")
# Mamba (adjoint sharding targets): hidden 256, state 16, expand 2 (D = 512 scan channels), 4 layers, V=32000.
MAMBA_BASE = dict(hidden_size=256, state_size=16, expand=2, num_hidden_layers=4, vocab_size=32000)


class MambaMethod(NamedTuple):
    adjoint_sharding_chunk: object  # None (upstream's scan) | "auto" | int
    mini_sequence_chunk: object  # chunked LM head + loss
    checkpointing: bool
    adjoint_truncation: int | None = None
    streaming_backward_chunk: object = None  # each layer streamed through its state (since 5.24.0+mst.33)


def mamba_methods(truncation):
    return {"upstream": MambaMethod(None, None, False), "upstream+checkpointing": MambaMethod(None, None, True),
            "adjoint": MambaMethod("auto", "auto", False), "adjoint+checkpointing": MambaMethod("auto", "auto", True),
            f"truncated T={truncation}": MambaMethod("auto", "auto", False, truncation),
            "streaming": MambaMethod(None, "auto", False, streaming_backward_chunk="auto")}
REPO = Path(__file__).resolve().parents[1]


def device_of(name):
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def build(family, chunk, checkpointing, device, dtype=torch.float32, streaming=None, **overrides):
    family_classes, extra = REGISTRY[family], FAMILIES[family]
    config = getattr(transformers, family_classes.config_class)(**{**BASE, **extra, **overrides}, mini_sequence_chunk=chunk,
                                                streaming_backward_chunk=streaming)
    if device.type == "cuda" and family != "gemma2":
        config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = getattr(transformers, family_classes.model_class)(config).to(device=device, dtype=dtype).train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    return model


def tokens(seq, vocab, device):
    return torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(seq)).to(device)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Trainee:
    """A model, its AdamW and a batch: `step()` runs one full training step."""

    def __init__(self, family, chunk, checkpointing, seq, device, dtype, streaming=None, compiled=False):
        self.model = build(family, chunk, checkpointing, device, dtype, streaming)
        if compiled:
            self.model.config.use_cache = False  # upstream warns (a graph break) when a checkpointed model is asked to cache
            self.model.compile()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.ids = tokens(seq, self.model.config.vocab_size, device)
        self.device = device
        self.fake = False  # a step under FakeTensorMode (MambaTrainee) has no loss value

    def step(self):
        loss = self.model(input_ids=self.ids, labels=self.ids).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return None if self.fake else loss.item()

    def timed_step(self):
        sync(self.device)
        start = time.perf_counter()
        self.step()
        sync(self.device)
        return time.perf_counter() - start

    def peak_step(self):
        """(peak bytes of one step including weights and optimizer states, loss)."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            loss = self.step()
            return torch.cuda.max_memory_allocated(self.device), loss
        resident = resident_training_bytes(self.model, self.optimizer)
        with LiveTensorTracker() as tracker:
            loss = self.step()
        return resident + tracker.peak_bytes, loss


def peak_above_start_bytes(trainee):
    """Peak bytes allocated during one step above what was allocated at its start, every tensor counted, compiled
    code's buffers included: on CUDA the allocator's peak; on the CPU the peak of torch.profiler's memory timeline
    (torch's CPU allocator, which inductor's generated code allocates through too, where `LiveTensorTracker`, a
    dispatch mode, sees only tensors returned by operators). For an eager step the two CPU measures agree (fp32 Llama,
    d=256, 2 layers: 179.40 against 179.37 MiB at 4K with mini_sequence+checkpointing, 761.03 against 761.02 at 2K
    with checkpointing)."""
    if trainee.device.type == "cuda":
        sync(trainee.device)
        start = torch.cuda.memory_allocated(trainee.device)
        torch.cuda.reset_peak_memory_stats(trainee.device)
        trainee.step()
        return torch.cuda.max_memory_allocated(trainee.device) - start
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        trainee.step()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "timeline.json"
        # Deprecated in torch 2.13 in favour of CUDA-only memory snapshots: nothing replaces it for the CPU yet.
        prof.export_memory_timeline(str(path), device="cpu")
        _, sizes = json.loads(path.read_text())  # [times, bytes per category at each time]
    totals = [sum(at) for at in sizes]
    return max(totals) - totals[0]


def trainee(family, method: Method, seq, device, dtype, compiled=False):
    return Trainee(family, method.mini_sequence_chunk, method.checkpointing, seq, device, dtype,
                   method.streaming_backward_chunk, compiled)


class MambaTrainee(Trainee):
    """A MambaForCausalLM trainee; `warm_up()` runs one step on a short prefix (AdamW states, first-call
    costs) so that upstream's slow long steps run only where they are measured."""

    WARM_UP_TOKENS = 64

    def __init__(self, method: MambaMethod, seq, device, dtype, fake=False):
        config = transformers.MambaConfig(**MAMBA_BASE, adjoint_sharding_chunk=method.adjoint_sharding_chunk,
                                          adjoint_truncation=method.adjoint_truncation,
                                          mini_sequence_chunk=method.mini_sequence_chunk,
                                          streaming_backward_chunk=method.streaming_backward_chunk, use_cache=False)
        torch.manual_seed(0)
        self.model = transformers.MambaForCausalLM(config).train()
        if not fake:  # (a fake model stays as built: CPU, fp32)
            self.model.to(device=device, dtype=dtype)
        if method.checkpointing:
            self.model.gradient_checkpointing_enable()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        # Fake tensors have no values (the ids' values change no shape, so zeros there).
        self.ids = torch.zeros(1, seq, dtype=torch.long, device=device) if fake else tokens(seq, config.vocab_size, device)
        self.device = device
        self.fake = fake

    def warm_up(self):
        ids, self.ids = self.ids, self.ids[:, : self.WARM_UP_TOKENS]
        self.step()
        self.ids = ids


def fake_peak_bytes(method: MambaMethod, seq, dtype):
    """`peak_step()`'s quantity for a step run under FakeTensorMode (as the planner does): every
    operator runs on shapes only, so the allocations are the real step's without its compute."""
    if dtype != torch.float32:
        raise ValueError(f"fake-tensor peaks are measured in float32 only, got {dtype}")
    with FakeTensorMode():
        fake = MambaTrainee(method, seq, torch.device("cpu"), dtype, fake=True)
        fake.warm_up()
        peak, _ = fake.peak_step()
    return peak


def compare_steps(trainees, repeats, progress):
    """Warm-up (allocates optimizer states), one measured-memory step, then interleaved timed steps."""
    results = {}
    for name, trainee in trainees.items():
        first_loss = trainee.step()
        peak, _ = trainee.peak_step()
        results[name] = {"peak_bytes": peak, "first_loss": first_loss, "times": []}
        progress.update(2)
    for _ in range(repeats):
        for name, trainee in trainees.items():
            results[name]["times"].append(trainee.timed_step())
            progress.update(1)
    for r in results.values():
        times = r.pop("times")
        r["step_time_s"] = statistics.median(times) if times else None  # repeats=0: memory only
    return results


# ----------------------------------------------------------------------------- the sweeps


def sweep_methods(args, device):
    rows = []
    methods = {name: METHODS[name] for name in args.methods}
    steps = len(args.seq) * len(methods) * (2 + args.repeats)
    with tqdm(total=steps, desc=f"methods ({args.family})", file=sys.stderr) as progress:
        for seq in args.seq:
            trainees = {m: trainee(args.family, method, seq, device, args.dtype) for m, method in methods.items()}
            for method, r in compare_steps(trainees, args.repeats, progress).items():
                rows.append({"family": args.family, "seq_len": seq, "method": method, **r})
            del trainees
    for r in rows:
        r["peak_MiB"] = round(r.pop("peak_bytes") / MIB, 1)
    # Ratios to the reference methods that ran (--methods may leave one out).
    vanilla = {r["seq_len"]: r for r in rows if r["method"] == "vanilla"}
    checkpointing = {r["seq_len"]: r for r in rows if r["method"] == "checkpointing"}
    for r in rows:
        for key, value, refs in (("peak_vs_vanilla", "peak_MiB", vanilla), ("peak_vs_checkpointing", "peak_MiB", checkpointing),
                                 ("time_vs_vanilla", "step_time_s", vanilla),
                                 ("time_vs_checkpointing", "step_time_s", checkpointing)):
            ref = refs.get(r["seq_len"])
            r[key] = round(r[value] / ref[value], 3) if ref and ref[value] else None
    for r in rows:  # rounded only once every ratio is computed from the full values
        r["step_time_s"] = round(r["step_time_s"], 3)
        r["first_loss"] = round(r["first_loss"], 6)
    return rows


def sweep_compile(args, device):
    """Each method compiled (`model.compile()`): graph breaks of its first (compiling) step, counted by dynamo
    (each break of each compiled frame once), and the median step time against the compiled step of the same
    setting with our fields unset (vanilla for vanilla and mini_sequence, checkpointing for the rest)."""
    from torch._dynamo.utils import counters

    rows = []
    methods = {name: METHODS[name] for name in args.methods}
    # The models share code objects: each method compiles from an empty cache (`reset`), so that its breaks are
    # counted; the reset makes the methods before it recompile, which they do in the untimed warm-up round. No
    # silent eager fallback at the default recompile limit.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(methods) * len(args.seq))
    with tqdm(total=len(args.seq) * len(methods) * (2 + args.repeats), desc="compile", file=sys.stderr) as progress:
        for seq in args.seq:
            trainees, breaks, first_step = {}, {}, {}
            for name, method in methods.items():
                torch._dynamo.reset()
                counters.clear()
                trainees[name] = trainee(args.family, method, seq, device, args.dtype, compiled=True)
                start = time.perf_counter()
                first_loss = trainees[name].step()  # compiles
                first_step[name] = time.perf_counter() - start
                breaks[name] = (sum(counters["graph_break"].values()), first_loss)
                progress.update(1)
            for t in trainees.values():
                t.step()
                progress.update(1)
            times = {name: [] for name in methods}
            # Graphs dynamo makes during the timed steps: a recompilation, step after step (none expected: every
            # method compiled its graphs in the two steps above).
            recompiled = dict.fromkeys(methods, 0)
            for _ in range(args.repeats):
                for name, t in trainees.items():
                    graphs = counters["stats"]["unique_graphs"]
                    times[name].append(t.timed_step())
                    recompiled[name] += counters["stats"]["unique_graphs"] - graphs
                    progress.update(1)
            peaks = {name: peak_above_start_bytes(t) for name, t in trainees.items()}
            del trainees
            for name, method in methods.items():
                eager = trainee(args.family, method, seq, device, args.dtype)
                eager.step()  # AdamW's states
                eager_time = statistics.median(eager.timed_step() for _ in range(args.repeats))
                eager_peak = peak_above_start_bytes(eager)
                del eager
                step_time = statistics.median(times[name])
                rows.append({"family": args.family, "seq_len": seq, "method": name, "graph_breaks": breaks[name][0],
                             "first_loss": round(breaks[name][1], 6), "step_time_s": step_time,
                             "first_step_s": round(first_step[name], 1),
                             "first_step_extra_s": round(first_step[name] - step_time, 1),
                             "recompiled_graphs": recompiled[name],
                             "speed_vs_eager": round(eager_time / step_time, 3),
                             "peak_MiB": round(peaks[name] / MIB, 1), "eager_peak_MiB": round(eager_peak / MIB, 1),
                             "peak_vs_eager": round(peaks[name] / eager_peak, 3)})
    for r in rows:
        reference = "checkpointing" if METHODS[r["method"]].checkpointing or METHODS[r["method"]].streaming_backward_chunk else "vanilla"
        ref = next((q for q in rows if q["seq_len"] == r["seq_len"] and q["method"] == reference), None)
        r["speed_vs_unset"] = round(ref["step_time_s"] / r["step_time_s"], 3) if ref else None
        r["unset_reference"] = reference if ref else None
    for r in rows:
        r["step_time_s"] = round(r["step_time_s"], 3)
    return rows


def sweep_blocks(args, device):
    """MLP and LM head + loss alone, forward + backward, vs M (App. F); M=1 is the upstream code."""
    d, vocab = BASE["hidden_size"], BASE["vocab_size"]
    config = transformers.LlamaConfig(**BASE)
    torch.manual_seed(0)
    mlp = transformers.models.llama.modeling_llama.LlamaMLP(config).to(device, args.dtype)
    head = torch.nn.Linear(d, vocab, bias=False).to(device, args.dtype)
    rows = []
    jobs = [(block, seq, m) for block in ("mlp", "lm_head") for seq in args.seq for m in args.mini_sequences]
    for block, seq, m in tqdm(jobs, desc="blocks", file=sys.stderr):
        x = torch.randn(1, seq, d, device=device, dtype=args.dtype, requires_grad=True)
        labels = tokens(seq, vocab, device)
        chunk = math.ceil(seq / m)
        if block == "mlp":
            def run():
                out = mlp(x) if m == 1 else mini_sequence_mlp(mlp, x, chunk)
                out.backward(torch.ones_like(out))
        else:
            def run():
                if m == 1:
                    loss = ForCausalLMLoss(head(x), labels, vocab)
                else:
                    loss = mini_sequence_causal_lm_loss(x, head, labels, chunk_size=chunk, vocab_size=vocab)
                loss.backward()
        run()  # warm-up
        times = []
        for _ in range(args.repeats):
            sync(device)
            start = time.perf_counter()
            run()
            sync(device)
            times.append(time.perf_counter() - start)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            run()
            peak = torch.cuda.max_memory_allocated(device)
        else:
            with LiveTensorTracker() as tracker:
                run()
            peak = tracker.peak_bytes
        rows.append({"block": block, "seq_len": seq, "mini_sequences": m, "chunk_tokens": chunk,
                     "peak_MiB": round(peak / MIB, 1), "time_s": round(statistics.median(times), 4)})
        x.grad = None
        mlp.zero_grad(set_to_none=True)
        head.zero_grad(set_to_none=True)
    return rows


def sweep_families(args, device):
    rows = []
    steps = len(args.families) * 2 * (2 + args.repeats)
    with tqdm(total=steps, desc="families", file=sys.stderr) as progress:
        for family in args.families:
            trainees = {c: Trainee(family, c, args.checkpointing, args.seq[0], device, args.dtype) for c in (None, args.chunk)}
            r = compare_steps(trainees, args.repeats, progress)
            off, on = r[None], r[args.chunk]
            rows.append({"family": family, "seq_len": args.seq[0], "chunk": args.chunk,
                         "checkpointing": args.checkpointing,
                         "peak_off_MiB": round(off["peak_bytes"] / MIB, 1), "peak_on_MiB": round(on["peak_bytes"] / MIB, 1),
                         "peak_on_vs_off": round(on["peak_bytes"] / off["peak_bytes"], 3),
                         "loss_off": round(off["first_loss"], 6), "loss_on": round(on["first_loss"], 6),
                         "time_off_s": round(off["step_time_s"], 3), "time_on_s": round(on["step_time_s"], 3),
                         "time_on_vs_off": round(on["step_time_s"] / off["step_time_s"], 3)})
    return rows


def sweep_streaming(args, device):
    """StreamBP on the CPU targets, one run, every point measured here:

    gemma2      Gemma-2 (bench config, eager attention) at --gemma2-seq: peak of a full training step,
                flag off against mini_sequence_chunk="auto" alone and with streaming_backward_chunk="auto";
    activation  Llama BASE at --activation-seq, fp32 and bf16: activation memory = peak of one forward +
                backward minus weights and gradients (the optimizer is left out: its states are the same for
                both and its step allocates no activations; one pass per point, as S=32K costs minutes on CPU),
                mini_sequence+streaming against mini_sequence+checkpointing;
    chunks      Llama BASE at each --chunk-seq: mini_sequence+checkpointing and mini_sequence+streaming with
                each --streaming-chunks value, steps interleaved: peak and median step time (the "auto" row
                against mini_sequence+checkpointing is the step-time target).
    """
    rows = []
    ms_ckpt, ms_stream = METHODS["mini_sequence+checkpointing"], METHODS["mini_sequence+streaming"]

    def run(part, family, dtype, seq, trainees, repeats, reference):
        with tqdm(total=len(trainees) * (2 + repeats), desc=f"streaming: {part} S={seq}", file=sys.stderr) as progress:
            results = compare_steps(trainees, repeats, progress)
        ref = results[reference]
        for name, r in results.items():
            model = trainees[name].model
            state = resident_training_bytes(model, trainees[name].optimizer) + sum(
                q.numel() * q.element_size() for q in model.parameters() if q.requires_grad)  # + gradients
            rows.append({"part": part, "family": family, "dtype": str(dtype).removeprefix("torch."), "seq_len": seq,
                         "setting": name, "peak_MiB": round(r["peak_bytes"] / MIB, 1),
                         "activation_MiB": round((r["peak_bytes"] - state) / MIB, 1),
                         "step_time_s": round(r["step_time_s"], 3) if repeats else None,
                         "first_loss": round(r["first_loss"], 6), "reference": reference,
                         "peak_vs_ref": round(r["peak_bytes"] / ref["peak_bytes"], 3),
                         "activation_vs_ref": round((r["peak_bytes"] - state) / (ref["peak_bytes"] - state), 3),
                         "time_vs_ref": round(r["step_time_s"] / ref["step_time_s"], 3) if repeats else None})
        return results

    if "gemma2" in args.parts:
        seq = args.gemma2_seq
        settings = {"flag off": Method(None, False), "mini_sequence": METHODS["mini_sequence"],
                    "mini_sequence+streaming": ms_stream}
        trainees = {name: trainee("gemma2", m, seq, device, torch.float32) for name, m in settings.items()}
        run("gemma2", "gemma2", torch.float32, seq, trainees, 0, "flag off")
        del trainees
    activation_runs = itertools.product(args.activation_seq, args.activation_dtypes) if "activation" in args.parts else ()
    for seq, dtype in activation_runs:
        results = {}
        for name in ("mini_sequence+checkpointing", "mini_sequence+streaming"):
            t = trainee("llama", METHODS[name], seq, device, dtype)
            weights = resident_training_bytes(t.model)
            grads = sum(q.numel() * q.element_size() for q in t.model.parameters() if q.requires_grad)
            print(f"streaming: activation {name} {dtype} S={seq} ...", file=sys.stderr, flush=True)
            with LiveTensorTracker() as tracker:  # (CPU; on CUDA use the chunks part)
                loss = t.model(input_ids=t.ids, labels=t.ids).loss
                loss.backward()
            results[name] = (weights + tracker.peak_bytes, tracker.peak_bytes - grads, loss.item())
            del t, loss
        ref = results["mini_sequence+checkpointing"]
        for name, (peak, activation, loss) in results.items():
            rows.append({"part": "activation", "family": "llama", "dtype": str(dtype).removeprefix("torch."),
                         "seq_len": seq, "setting": name, "peak_MiB": round(peak / MIB, 1),
                         "activation_MiB": round(activation / MIB, 1), "step_time_s": None,
                         "first_loss": round(loss, 6), "reference": "mini_sequence+checkpointing",
                         "peak_vs_ref": round(peak / ref[0], 3), "activation_vs_ref": round(activation / ref[1], 3),
                         "time_vs_ref": None})
    if "chunks" in args.parts:
        for seq in args.chunk_seq:
            trainees = {"mini_sequence+checkpointing": trainee("llama", ms_ckpt, seq, device, args.dtype)}
            for chunk in args.streaming_chunks:
                trainees[f"mini_sequence+streaming chunk={chunk}"] = trainee(
                    "llama", ms_stream._replace(streaming_backward_chunk=chunk), seq, device, args.dtype)
            run("chunks", "llama", args.dtype, seq, trainees, args.repeats, "mini_sequence+checkpointing")
            del trainees
    return rows


def streaming_summary(rows):
    """The issue-7 CPU targets, from the rows just measured."""
    lines = []
    for r in rows:
        if r["part"] == "gemma2" and r["setting"] == "mini_sequence+streaming":
            lines.append(f"- Gemma-2 S={r['seq_len']}: peak with both flags {r['peak_vs_ref']} of flag off (target <= 0.30)")
        if r["part"] == "activation" and r["setting"] == "mini_sequence+streaming":
            lines.append(f"- Llama d={BASE['hidden_size']} S={r['seq_len']} {r['dtype']}: activation memory "
                         f"{r['activation_MiB']} MiB = {r['activation_vs_ref']} of mini_sequence+checkpointing's "
                         f"(target <= 0.5)")
        if r["part"] == "chunks" and r["setting"] == "mini_sequence+streaming chunk=auto":
            lines.append(f"- Llama S={r['seq_len']} {r['dtype']}: step time mini_sequence+streaming (auto) "
                         f"{r['step_time_s']} s = {r['time_vs_ref']}x mini_sequence+checkpointing's, speed "
                         f"{round(1 / r['time_vs_ref'], 3)}x (target >= 0.8x); peak {r['peak_vs_ref']} of its peak")
    return "\n".join(lines)


UPSTREAM_METHODS = ("upstream", "upstream+checkpointing")
MAMBA_METHOD_NAMES = ["upstream", "upstream+checkpointing", "adjoint", "adjoint+checkpointing", "truncated", "streaming"]


def sweep_mamba(args, device):
    """Adjoint sharding, Mamba (MAMBA_BASE), every point measured in this run:

    methods  at each --seq, the six methods (`mamba_methods`): peak of a full training step and median
             step time of --repeats interleaved steps (--upstream-repeats for upstream's two, whose steps
             take minutes). Upstream's methods run for real up to --upstream-max-seq; at the --fake-seq
             lengths above it, --fake-methods get their peak under FakeTensorMode (peak_kind "fake") and
             no time. At --fake-check-seq the real upstream rows also get the fake peak (fake_peak_MiB):
             the two agree when the fake measurement is right.
    shards   "adjoint" at --shard-seq with each --shards value of adjoint_sharding_chunk: peak, time.
    Every trainee first takes one AdamW step on a short prefix (`MambaTrainee.warm_up`); the loss is
    the measured-memory step's, the same for the exact methods.
    """
    methods = {n: m for n, m in mamba_methods(args.truncation).items() if n.split()[0] in args.mamba_methods}
    rows = []

    def measure(part, seq, settings, repeats_of):
        trainees = {name: MambaTrainee(m, seq, device, args.dtype) for name, m in settings.items()}
        results = {}
        total = sum(2 + repeats_of(name) for name in trainees)
        with tqdm(total=total, desc=f"mamba: {part} S={seq}", file=sys.stderr) as progress:
            for name, t in trainees.items():
                t.warm_up()
                peak, loss = t.peak_step()
                results[name] = {"peak_bytes": peak, "loss": loss, "times": []}
                progress.update(2)
            for i in range(max(repeats_of(name) for name in trainees)):
                for name, t in trainees.items():  # interleaved, so that machine noise hits all alike
                    if i < repeats_of(name):
                        results[name]["times"].append(t.timed_step())
                        progress.update(1)
        for name, r in results.items():
            times = r.pop("times")
            r["time"] = statistics.median(times) if times else None
            rows.append(row(part, seq, name, settings[name], r["peak_bytes"], "real", r["time"], r["loss"]))

    def row(part, seq, name, method, peak, kind, time_s, loss):
        chunk = method.adjoint_sharding_chunk
        return {"part": part, "seq_len": seq, "method": name,
                "shard_tokens": None if chunk is None else shard_tokens(chunk),
                "mini_sequence_chunk": method.mini_sequence_chunk, "checkpointing": method.checkpointing,
                "truncation": method.adjoint_truncation, "peak_bytes": peak, "peak_kind": kind,
                "fake_peak_MiB": None, "step_time_s": time_s, "ms_per_token": None if time_s is None else 1e3 * time_s / seq,
                "loss": None if loss is None else round(loss, 6)}

    if "methods" in args.parts:
        for seq in args.seq:
            real = {n: m for n, m in methods.items() if n not in UPSTREAM_METHODS or seq <= args.upstream_max_seq}
            measure("methods", seq, real, lambda n: args.upstream_repeats if n in UPSTREAM_METHODS else args.repeats)
            for name in (n for n in UPSTREAM_METHODS if n in methods):
                if name in real and seq == args.fake_check_seq:
                    print(f"mamba: fake-tensor peak of {name} at S={seq} (check) ...", file=sys.stderr, flush=True)
                    check = next(r for r in rows if (r["seq_len"], r["method"]) == (seq, name))
                    check["fake_peak_MiB"] = round(fake_peak_bytes(methods[name], seq, args.dtype) / MIB, 1)
                    print(f"mamba: {name} S={seq}: real peak {check['peak_bytes'] / MIB:.1f} MiB, "
                          f"fake peak {check['fake_peak_MiB']} MiB", file=sys.stderr, flush=True)
                elif name not in real and name in args.fake_methods and seq in args.fake_seq:
                    print(f"mamba: fake-tensor peak of {name} at S={seq} ...", file=sys.stderr, flush=True)
                    rows.append(row("methods", seq, name, methods[name], fake_peak_bytes(methods[name], seq, args.dtype),
                                    "fake", None, None))
    if "shards" in args.parts:
        adjoint = mamba_methods(args.truncation)["adjoint"]
        settings = {f"adjoint shard={c}": adjoint._replace(adjoint_sharding_chunk=c) for c in args.shards}
        measure("shards", args.shard_seq, settings, lambda n: args.repeats)

    order = {name: i for i, name in enumerate(methods)}
    rows.sort(key=lambda r: (r["part"] != "methods", r["seq_len"], order.get(r["method"], len(order)), r["shard_tokens"] or 0))
    upstream = {r["seq_len"]: r for r in rows if r["part"] == "methods" and r["method"] == "upstream"}
    for r in rows:
        ref = upstream.get(r["seq_len"])
        r["peak_vs_upstream"] = round(r["peak_bytes"] / ref["peak_bytes"], 3) if ref else None
        both = ref and r["step_time_s"] is not None and ref["step_time_s"] is not None
        r["time_vs_upstream"] = round(r["step_time_s"] / ref["step_time_s"], 4) if both else None
    for r in rows:  # rounded only once every ratio is computed from the full values
        r["peak_MiB"] = round(r.pop("peak_bytes") / MIB, 1)
        r["step_time_s"] = None if r["step_time_s"] is None else round(r["step_time_s"], 3)
        r["ms_per_token"] = None if r["ms_per_token"] is None else round(r["ms_per_token"], 3)
    # Column order: the measurements after the settings.
    keys = ["part", "seq_len", "method", "shard_tokens", "mini_sequence_chunk", "checkpointing", "truncation",
            "peak_MiB", "peak_kind", "fake_peak_MiB", "peak_vs_upstream", "step_time_s", "ms_per_token",
            "time_vs_upstream", "loss"]
    return [{k: r[k] for k in keys} for r in rows]


def mamba_summary(rows, args):
    """The issue-9 CPU targets, from the rows just measured."""
    lines = []
    methods = [r for r in rows if r["part"] == "methods"]
    for r in methods:
        if r["fake_peak_MiB"] is not None:
            lines.append(f"- Fake-tensor check, {r['method']} S={r['seq_len']}: real peak {r['peak_MiB']} MiB, "
                         f"FakeTensorMode peak {r['fake_peak_MiB']} MiB")
    for r in methods:
        if r["method"] == "adjoint" and r["peak_vs_upstream"] is not None:
            ref = next(u for u in methods if u["seq_len"] == r["seq_len"] and u["method"] == "upstream")
            lines.append(f"- S={r['seq_len']}: peak adjoint (+mini_sequence) {r['peak_MiB']} MiB / upstream "
                         f"{ref['peak_MiB']} MiB ({ref['peak_kind']}) = {r['peak_vs_upstream']} (target <= 0.333 at S=8192)")
    for r in methods:
        if r["method"] == "adjoint" and r["time_vs_upstream"] is not None:
            ref = next(u for u in methods if u["seq_len"] == r["seq_len"] and u["method"] == "upstream")
            lines.append(f"- S={r['seq_len']}: step time adjoint {r['step_time_s']} s / upstream {ref['step_time_s']} s "
                         f"= {r['time_vs_upstream']} (target <= 0.1 at S=4096)")
    growth = [r for r in methods if r["method"] == "adjoint" and r["step_time_s"] is not None]
    if growth:
        lines.append("- adjoint step time by S (ms per token): " + ", ".join(
            f"{r['seq_len']}: {r['step_time_s']} s ({r['ms_per_token']})" for r in growth))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- output


def markdown(rows):
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def plot(rows, x, y, line, title, path, ylabel, logx=False):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in dict.fromkeys(r[line] for r in rows):
        points = sorted((r[x], r[y]) for r in rows if r[line] == name)
        ax.plot(*zip(*points), marker="o", label=str(name))
    ax.set_xlabel(x)
    ax.set_ylabel(ylabel)
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(rows, out, name, header):
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{name}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    table = f"{header}\n\n{markdown(rows)}\n"
    (out / f"{name}.md").write_text(table)
    print(table)


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep", choices=["methods", "blocks", "families", "streaming", "mamba", "compile", "host",
                                          "hybrids"])
    parser.add_argument("--family", default="llama", choices=list(FAMILIES), help="for `methods` and `compile`")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS), help="for `methods` and `compile`")
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES), help="for `families`")
    parser.add_argument("--seq", type=int, nargs="+", help="sequence lengths (default per sweep)")
    parser.add_argument("--mini-sequences", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32], help="M, for `blocks`")
    parser.add_argument("--chunk", default="auto", help='mini_sequence_chunk for `families` (default "auto")')
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing on, for `families`")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per point (median)")
    parser.add_argument("--parts", nargs="+", default=list(STREAMING_PARTS), choices=list(STREAMING_PARTS),
                        help="for `streaming`: which parts to run")
    parser.add_argument("--gemma2-seq", type=int, default=4096, help="for `streaming` (gemma2 part)")
    parser.add_argument("--activation-seq", type=int, nargs="+", default=[32768], help="for `streaming` (activation part)")
    parser.add_argument("--activation-dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"],
                        help="for `streaming` (activation part)")
    parser.add_argument("--chunk-seq", type=int, nargs="+", default=[8192, 16384], help="for `streaming` (chunks part)")
    parser.add_argument("--streaming-chunks", nargs="+", default=["256", "512", "1024", "2048", "4096", "auto"],
                        help='streaming_backward_chunk values for `streaming` (chunks part): ints or "auto"')
    parser.add_argument("--mamba-parts", nargs="+", default=list(MAMBA_PARTS), choices=list(MAMBA_PARTS),
                        help="for `mamba`: which parts to run")
    parser.add_argument("--mamba-methods", nargs="+", default=MAMBA_METHOD_NAMES, choices=MAMBA_METHOD_NAMES,
                        help="for `mamba` (methods part): which methods to run")
    parser.add_argument("--name", default="mamba", help="for `mamba`: output files <out>/<name>*.csv|md|png")
    parser.add_argument("--truncation", type=int, default=64, help="adjoint_truncation of the truncated method (`mamba`)")
    parser.add_argument("--upstream-max-seq", type=int, default=512,
                        help="for `mamba`: upstream's torch path runs for real up to this S (its backward is quadratic on "
                             "CPU: over a minute per step at 512 on 2 cores, over 10 minutes at 1024 on a loaded machine)")
    parser.add_argument("--upstream-repeats", type=int, default=1, help="for `mamba`: timed steps of the upstream methods")
    parser.add_argument("--fake-seq", type=int, nargs="+", default=[8192],
                        help="for `mamba`: S above --upstream-max-seq where the upstream methods' peak is measured "
                             "under FakeTensorMode")
    parser.add_argument("--fake-methods", nargs="+", default=["upstream"], choices=list(UPSTREAM_METHODS),
                        help="for `mamba`: the upstream methods measured at --fake-seq")
    parser.add_argument("--fake-check-seq", type=int, default=512,
                        help="for `mamba`: S where the upstream methods' fake peak is checked against the real one")
    parser.add_argument("--shard-seq", type=int, default=8192, help="for `mamba` (shards part)")
    parser.add_argument("--shards", type=int, nargs="+", default=[64, 128, 256, 512, 1024, 2048],
                        help="adjoint_sharding_chunk values for `mamba` (shards part)")
    parser.add_argument("--device", default="auto", help="cpu, cuda, or auto (cuda if available)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--out", type=Path, default=REPO / "out" / "bench",
                        help="output folder (default out/bench, ignored by git; docs/bench holds the committed results)")
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.chunk != "auto":
        args.chunk = int(args.chunk)
    args.dtype = getattr(torch, args.dtype)
    args.seq = args.seq or {"methods": [1024, 2048, 4096, 8192], "blocks": [2048, 8192], "families": [4096],
                           "streaming": [4096], "mamba": [512, 1024, 2048, 4096, 8192], "compile": [4096],
                           "host": [host_cost.SEQ_LEN], "hybrids": [8192, 16384]}[args.sweep]  # (streaming has its own --*-seq options)
    if any(s < 2 for s in args.seq) or args.repeats < 1:
        parser.error("--seq values must be >= 2 and --repeats >= 1")
    if min(args.truncation, args.upstream_repeats, args.shard_seq, args.fake_check_seq, *args.shards, *args.fake_seq) < 1:
        parser.error("--truncation, --upstream-repeats, --shard-seq, --fake-check-seq, --fake-seq and --shards "
                     "values must be positive ints")
    args.activation_dtypes = [getattr(torch, d) for d in args.activation_dtypes]
    if min(args.gemma2_seq, *args.activation_seq, *args.chunk_seq) < 2:
        parser.error("--gemma2-seq, --activation-seq and --chunk-seq values must be >= 2")
    try:
        args.streaming_chunks = [c if c == "auto" else int(c) for c in args.streaming_chunks]
    except ValueError:
        parser.error(f'--streaming-chunks {" ".join(args.streaming_chunks)}: each must be a positive int or "auto"')
    if any(c != "auto" and c < 1 for c in args.streaming_chunks):
        parser.error(f'--streaming-chunks: each must be a positive int or "auto", got {args.streaming_chunks}')
    device = device_of(args.device)

    where = (f"{torch.cuda.get_device_name(device)} (CUDA allocator peak)" if device.type == "cuda"
             else f"CPU, {torch.get_num_threads()} threads (live tensor bytes + weights and optimizer states)")
    header = (f"transformers {transformers.__version__}, torch {torch.__version__}, {where}; "
              f"d={BASE['hidden_size']} I={BASE['intermediate_size']} V={BASE['vocab_size']} "
              f"{BASE['num_hidden_layers']} layers, batch 1, {str(args.dtype).removeprefix('torch.')}; "
              f"time = median of {args.repeats} steps after a warm-up")
    if args.sweep == "methods":
        rows = sweep_methods(args, device)
        write(rows, args.out, f"methods_{args.family}", header)
        plot(rows, "seq_len", "peak_MiB", "method", f"{args.family}: peak memory of a training step\n{where}",
             args.out / f"methods_{args.family}_memory.png", "peak (MiB)", logx=True)
        plot(rows, "seq_len", "step_time_s", "method", f"{args.family}: time of a training step\n{where}",
             args.out / f"methods_{args.family}_time.png", "step time (s)", logx=True)
    elif args.sweep == "blocks":
        rows = sweep_blocks(args, device)
        write(rows, args.out, "blocks", header.replace("batch 1", "batch 1, one block alone, forward + backward"))
        for block in ("mlp", "lm_head"):
            part = [dict(r, S=f"S={r['seq_len']}") for r in rows if r["block"] == block]
            plot(part, "mini_sequences", "peak_MiB", "S", f"{block}: peak memory vs M (App. F)\n{where}",
                 args.out / f"blocks_{block}_memory.png", "peak (MiB)", logx=True)
            plot(part, "mini_sequences", "time_s", "S", f"{block}: time vs M (App. F)\n{where}",
                 args.out / f"blocks_{block}_time.png", "forward + backward (s)", logx=True)
    elif args.sweep == "mamba":
        if device.type != "cpu":
            parser.error("the mamba sweep measures the CPU torch path (--device cpu)")
        args.parts = args.mamba_parts
        rows = sweep_mamba(args, device)
        cfg = MAMBA_BASE
        header = (f"transformers {transformers.__version__}, torch {torch.__version__}, {where}; MambaForCausalLM "
                  f"d={cfg['hidden_size']} N={cfg['state_size']} expand={cfg['expand']} {cfg['num_hidden_layers']} layers "
                  f"V={cfg['vocab_size']}, batch 1, {str(args.dtype).removeprefix('torch.')}; time = median of "
                  f"{args.repeats} interleaved steps ({args.upstream_repeats} for upstream) after a warm-up step on "
                  f"{MambaTrainee.WARM_UP_TOKENS} tokens; peak_kind fake: measured under FakeTensorMode (no time)")
        summary = mamba_summary(rows, args)
        methods = [r for r in rows if r["part"] == "methods"]
        shards = [r for r in rows if r["part"] == "shards"]
        if methods:
            write(methods, args.out, args.name, f"{header}\n\nTargets, from this run:\n{summary}")
            plot(methods, "seq_len", "peak_MiB", "method",
                 f"Mamba: peak memory of a training step (upstream above S={args.upstream_max_seq}: fake tensors)\n{where}",
                 args.out / f"{args.name}_memory.png", "peak (MiB)", logx=True)
            plot([r for r in methods if r["step_time_s"] is not None], "seq_len", "step_time_s", "method",
                 f"Mamba: time of a training step\n{where}", args.out / f"{args.name}_time.png", "step time (s)", logx=True)
        if shards:
            write(shards, args.out, f"{args.name}_shards", header)
            part = [dict(r, S=f"S={r['seq_len']}") for r in shards]
            plot(part, "shard_tokens", "step_time_s", "S", f"adjoint: step time vs adjoint_sharding_chunk\n{where}",
                 args.out / f"{args.name}_shards_time.png", "step time (s)", logx=True)
            plot(part, "shard_tokens", "peak_MiB", "S", f"adjoint: peak vs adjoint_sharding_chunk\n{where}",
                 args.out / f"{args.name}_shards_memory.png", "peak (MiB)", logx=True)
    elif args.sweep == "host":
        if device.type != "cpu" or args.seq != [host_cost.SEQ_LEN]:
            parser.error(f"the host sweep counts a fixed CPU setup (--device cpu, {host_cost.SEQ_LEN} tokens)")
        rows = host_cost.sweep_host(repeats=args.repeats)
        write(rows, args.out, "host", host_cost.header())
    elif args.sweep == "hybrids":
        if device.type != "cpu":
            parser.error("the hybrids sweep measures the CPU torch path (--device cpu)")
        runs = len(args.seq) * len(hybrid_bench.METHODS) * len(hybrid_bench.MODELS)
        with tqdm(total=runs, desc="hybrids", file=sys.stderr) as progress:
            rows = hybrid_bench.sweep_hybrids(args.seq, args.repeats, progress=progress)
        write(rows, args.out, "hybrids", hybrid_bench.header(args.repeats))
    elif args.sweep == "compile":
        rows = sweep_compile(args, device)
        header = header.replace(" (live tensor bytes + weights and optimizer states)", "")
        header = header.replace("time = median", "model.compile(); graph_breaks: dynamo's count at the compiling step; "
                                "speed_vs_unset: the compiled unset_reference step time over this one (>1: faster); "
                                "speed_vs_eager: the same method's eager step time over this one (timed after the "
                                "compiled steps, median of as many); "
                                "peak_MiB / eager_peak_MiB: bytes allocated during one step above its start, compiled / "
                                "the same method eager (CPU: torch.profiler's memory timeline, inductor's buffers "
                                "included); first_step_s: the compiling step's time (dynamo and inductor, with inductor's "
                                "on-disk cache as found), first_step_extra_s: what a user waits for once, that time "
                                "less a compiled step's; recompiled_graphs: graphs dynamo made during the timed steps "
                                "(0: no recompilation step after step); time = median")
        suffix = "" if args.dtype == torch.float32 else f"_{str(args.dtype).removeprefix('torch.')}"
        write(rows, args.out, f"compile_{args.family}{suffix}", header)
    elif args.sweep == "families":
        rows = sweep_families(args, device)
        write(rows, args.out, "families", header)
    else:
        rows = sweep_streaming(args, device)
        header = header.replace(f", {str(args.dtype).removeprefix('torch.')};", ", dtype per row;")
        header = header.replace(f"median of {args.repeats} steps", f"median of {args.repeats} interleaved steps (chunks part)")
        summary = streaming_summary(rows)
        name = "streaming" if set(args.parts) == set(STREAMING_PARTS) else "streaming_" + "_".join(args.parts)
        write(rows, args.out, name, f"{header}\n\nTargets, from this run:\n{summary}")
        chunks = [dict(r, S=f"S={r['seq_len']}", chunk=int(r["setting"].rpartition("=")[2])) for r in rows
                  if r["part"] == "chunks" and "chunk=" in r["setting"] and r["setting"][-1].isdigit()]
        if chunks:
            plot(chunks, "chunk", "step_time_s", "S", f"mini_sequence+streaming: step time vs chunk\n{where}",
                 args.out / "streaming_chunks_time.png", "step time (s)", logx=True)
            plot(chunks, "chunk", "peak_MiB", "S", f"mini_sequence+streaming: peak vs chunk\n{where}",
                 args.out / "streaming_chunks_memory.png", "peak (MiB)", logx=True)


if __name__ == "__main__":
    main()

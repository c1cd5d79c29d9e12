"""Host work of a training step per method: what a GPU waits on when the step is host-bound (`bench.py host`).

Each aten operator a step dispatches is at least one kernel launch on a GPU, or host work before one: counted
exactly, on any machine, by a `TorchDispatchMode` (`OperatorCount`). Views and other metadata-only operators
(`OpOverload.is_view`, `detach`) launch nothing but still cost the host a dispatch: reported apart as `view_ops`.
Where part of a step runs compiled, inductor's generated kernels bypass the dispatcher: not counted here (no method
of ours compiles its chunks; a compiled step is measured by `bench.py compile`, compiled chunk bodies of the streamed
layer by `streamed_compile_probe.py`, which counts launches with torch.profiler).

The model is a Llama-style stack narrow enough that its kernels take next to nothing (d=32, 16 layers, 512 tokens,
fp32), so the step's time on one thread is host time: Python, autograd and the dispatcher. Its chunks are as many as
"auto" gives Llama-3.2-1B (d=2048) at 16K tokens, asked of the library's own policies (`chunk_counts`): on the CPU
8 MLP mini-sequences and 8 streamed chunks per layer (chunks of 64 of the 512 tokens), on an accelerator, where the
policies keep chunks of at least 4096 tokens because each costs host work the GPU waits for, 4 and 4 (chunks of 128).

With `hooks`, every module gets a forward pre-hook that does nothing, as DeepSpeed ZeRO-3 (which gathers weights
there) and accelerate put them: our chunked paths then route every gradient through ordinary autograd
(mst_core/wrappers.py). `q_proj_passes` / `gate_proj_passes` count the tokens through those projections per token
of the step (checkpointing: 2.0, a forward and a recompute).
"""

import collections
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import transformers

SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=16, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=256, max_position_embeddings=4096)
SEQ_LEN = 512
# Whose chunk counts the narrow stack takes: Llama-3.2-1B's hidden size, at 16K tokens.
REFERENCE_HIDDEN_SIZE, REFERENCE_TOKENS = 2048, 16384
# method -> (mini-sequences, checkpointing, streamed chunks): which fields it sets
METHODS = {
    "checkpointing": (False, True, False),
    "mini_sequence+checkpointing": (True, True, False),
    "streaming": (False, False, True),
    "mini_sequence+streaming": (True, False, True),
}
# The device types whose "auto" chunk counts a step can take (`chunk_counts`); "cpu" is the default.
POLICIES = ("cpu", "cuda")


def chunk_counts(policy="cpu"):
    """(MLP mini-sequences, streamed chunks) per layer that "auto" gives the reference model at the reference length on
    a device of type `policy`: the library's own policy functions (mini_sequence/config.py, streaming_backward/
    config.py), so the bench follows them when they change."""
    from transformers.mini_sequence.config import mlp_chunk_size
    from transformers.streaming_backward.config import streaming_chunk_size

    sizes = (mlp_chunk_size("auto", REFERENCE_HIDDEN_SIZE, policy),
             streaming_chunk_size("auto", REFERENCE_HIDDEN_SIZE, policy))
    return tuple(-(-REFERENCE_TOKENS // size) for size in sizes)


def chunk_tokens(policy="cpu", seq_len=SEQ_LEN):
    """(MLP chunk, streamed chunk) in tokens of the narrow stack's `seq_len`: as many chunks as `chunk_counts`."""
    return tuple(-(-seq_len // count) for count in chunk_counts(policy))


_METADATA_ONLY = {"aten::detach", "aten::alias", "aten::_unsafe_view", "aten::lift_fresh"}


class OperatorCount(TorchDispatchMode):
    """Counts the aten operators dispatched while active: `total`, `views` (no kernel: views and metadata-only
    operators) and `by_name`; and, for each weight in `weights` ({name: [weight, ...]}), the rows multiplied by it as
    a forward projection does (x @ weight.T: a matrix product reading the weight's storage transposed), in `rows`.
    Counted at the matrix product, not by module hooks: a hook on a module changes which path our chunked code takes
    (mst_core/wrappers.py), and a projection whose output is replayed (streaming_backward/projections.py) is no pass."""

    def __init__(self, weights=None):
        super().__init__()
        self.total = self.views = 0
        self.by_name = collections.Counter()
        self.rows = collections.Counter()
        self._weights = {w.untyped_storage().data_ptr(): (name, w) for name, ws in (weights or {}).items() for w in ws}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.total += 1
        name = func._schema.name
        self.by_name[name] += 1
        if func.is_view or name in _METADATA_ONLY:
            self.views += 1
        elif name in ("aten::mm", "aten::addmm") and self._weights:
            x, w = args[-2], args[-1]
            named = self._weights.get(w.untyped_storage().data_ptr())
            if named is not None and w.shape == named[1].T.shape and w.stride() == named[1].T.stride():
                self.rows[named[0]] += x.shape[0]
        return func(*args, **(kwargs or {}))


def projection_weights(model, *names):
    """{name: the weights of every module called `name`} (q_proj, gate_proj: one per layer)."""
    weights = {name: [] for name in names}
    for module_name, module in model.named_modules():
        if module_name.rpartition(".")[2] in weights:
            weights[module_name.rpartition(".")[2]].append(module.weight)
    return weights


def build(method, hooks=False, seq_len=SEQ_LEN, shape=None, policy="cpu"):
    mini_sequence, checkpointing, streaming = METHODS[method]
    mlp_chunk, streamed_chunk = chunk_tokens(policy, seq_len)
    config = transformers.LlamaConfig(**{**SHAPE, **(shape or {})},
                                      mini_sequence_chunk=mlp_chunk if mini_sequence else None,
                                      streaming_backward_chunk=streamed_chunk if streaming else None,
                                      attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    if hooks:
        for module in model.modules():
            module.register_forward_pre_hook(lambda module, args: None)
    ids = torch.randint(0, config.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(seq_len))
    return model, ids


def step(model, ids):
    """Forward + backward (no optimizer: its work is the same for every method)."""
    model(input_ids=ids, labels=ids).loss.backward()
    model.zero_grad(set_to_none=True)


def counted_step(method, hooks=False, seq_len=SEQ_LEN, shape=None, policy="cpu"):
    """(OperatorCount, q_proj passes per token, gate_proj passes per token) of one step after a warm-up step."""
    model, ids = build(method, hooks, seq_len, shape, policy)
    step(model, ids)
    weights = projection_weights(model, "q_proj", "gate_proj")
    with OperatorCount(weights) as count:
        step(model, ids)
    passes = [count.rows[name] / (len(weights[name]) * ids.numel()) for name in ("q_proj", "gate_proj")]
    return count, *passes


def timed_steps(methods, hooks, repeats, policy="cpu"):
    """Median step time per method, the methods interleaved round by round after a warm-up."""
    models = {method: build(method, hooks, policy=policy) for method in methods}
    times = {method: [] for method in methods}
    for model, ids in models.values():
        step(model, ids)
    for _ in range(repeats):
        for method, (model, ids) in models.items():
            start = time.perf_counter()
            step(model, ids)
            times[method].append(time.perf_counter() - start)
    return {method: statistics.median(measured) for method, measured in times.items()}


def sweep_host(repeats=5, methods=tuple(METHODS), hooks_settings=(False, True), policies=POLICIES):
    """Rows: per chunk policy (`chunk_counts`), hooks setting and method, operators per step, view operators, passes
    per token through q_proj and gate_proj, and the host-bound step time (one thread), each also relative to
    checkpointing's with the same policy and hooks in the same run."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows = []
    try:
        for policy in policies:
            mlp_chunks, streamed_chunks = chunk_counts(policy)
            chunks = f"{policy} auto: {mlp_chunks} MLP, {streamed_chunks} streamed"
            for hooks in hooks_settings:
                times = timed_steps(methods, hooks, repeats, policy)
                for method in methods:
                    count, queries, gates = counted_step(method, hooks, policy=policy)
                    rows.append({"chunks": chunks, "hooks": "every module" if hooks else "none", "method": method,
                                 "aten_ops": count.total, "view_ops": count.views, "q_proj_passes": round(queries, 3),
                                 "gate_proj_passes": round(gates, 3), "step_time_ms": times[method] * 1e3})
    finally:
        torch.set_num_threads(threads)
    for row in rows:
        reference = next((r for r in rows if r["chunks"] == row["chunks"] and r["hooks"] == row["hooks"]
                          and r["method"] == "checkpointing"), None)
        for key, value in (("ops_vs_checkpointing", "aten_ops"), ("time_vs_checkpointing", "step_time_ms")):
            row[key] = round(row[value] / reference[value], 3) if reference else None
    for row in rows:
        row["step_time_ms"] = round(row["step_time_ms"], 1)
    return rows


def header():
    shape = ", ".join(f"{key}={value}" for key, value in SHAPE.items() if key != "max_position_embeddings")
    counts = "; ".join(f"{policy}: {chunk_counts(policy)[0]} MLP mini-sequences and {chunk_counts(policy)[1]} streamed "
                       f"chunks, chunks of {'/'.join(map(str, chunk_tokens(policy)))} tokens" for policy in POLICIES)
    return (f"transformers {transformers.__version__}, torch {torch.__version__}, CPU, 1 thread; LlamaForCausalLM "
            f"{shape}, {SEQ_LEN} tokens, batch 1, fp32, sdpa; chunks: as many as \"auto\" gives a model of hidden size "
            f"{REFERENCE_HIDDEN_SIZE} (Llama-3.2-1B) at {REFERENCE_TOKENS} tokens on each device type ({counts}); one "
            "forward + backward; aten_ops: operators dispatched (TorchDispatchMode), view_ops: those that launch no "
            "kernel; *_passes: tokens through that projection per token and layer; step time: median of interleaved "
            "steps after a warm-up; hooks: a no-op forward pre-hook on every module (as ZeRO-3)")

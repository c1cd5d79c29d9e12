"""How long a sequence fits on a GPU? Estimated on a CPU, without weights.

    python -m transformers.mst_planner.plan --model llama3-8b --gpu-memory-gib 80 [--json]
    python -m transformers.mst_planner.plan --model llama3-8b --gpu-memory-gib 80 \
        --gpus 8 --zero 3 --sp 8 --offload optimizer inputs   # per GPU of 8 (ZeRO-3, Ulysses)
    python -m transformers.mst_planner.plan --model llama3-8b --gpu-memory-gib 80 \
        --methods mini_sequence+streaming --seq-len 1048576     # does this length fit? (no search)
    ... --jobs 1                       # the methods' searches in one process (default: one per CPU core)

For each method (vanilla, checkpointing, mini_sequence, mini_sequence+checkpointing, streaming,
mini_sequence+streaming) it runs one training step (forward + backward) of the full-size model under `FakeTensorMode` on the
CPU device (tensors have shapes and dtypes but no memory; a fake `cuda` device crashes the
CPU build of torch, so fake CPU stands in for the GPU), measures the peak of live tensor bytes
with `LiveTensorTracker`, adds the resident weights and optimizer states, and searches the
largest sequence length (a multiple of --granularity) whose peak fits in the GPU memory. The step runs a
shallow stack of the model's decoder layers, from whose phases the full depth's peak follows to the byte
(layer_phases.py).
With several GPUs it runs the step of one rank (its share of the tokens and heads, ZeRO's
sharded states and gathered parameters, offloaded tensors moved out) and reports that GPU's
peak and the host memory the rank's offloaded tensors take.

Assumptions (printed with every result):
- batch 1; pure bf16 training: bf16 weights, activations and gradients, no fp32 master copy;
- optimizer states: `adamw` 2 fp32 tensors per parameter, `adamw-bf16` 2 bf16, `none` nothing;
  the optimizer step itself is in place (no foreach temporaries);
- `--optimizer-in-backward`: each gradient is applied and freed as soon as it is accumulated
  (paper App. D), so gradients never all live at once;
- attention is FlashAttention-style: only its output and a [B, H, S] fp32 log-sum-exp are kept
  for backward, no [S, S] tensor, no K/V expanded to all heads (upstream's own attention is
  replaced during planning by a stand-in that allocates just that, for every family; Gemma-2's
  softcapped attention is assumed to have such a kernel too). Checked on fake CPU: torch's SDPA
  itself takes its flash CPU kernel (no [S, S] scores) and its step peak equals the stand-in's,
  but HF's mask code, given fake tensors under gradient checkpointing, builds an [S, S] bool mask
  that a real run does not; the stand-in avoids that artefact;
- "mini_sequence" is `mini_sequence_chunk="auto"`; gradient checkpointing is upstream's
  `activation_checkpointing_enable()` (5.x name of `gradient_checkpointing_enable`; non-reentrant);
- "streaming" is `streaming_backward_chunk` = --streaming-chunk (default "auto"), without
  checkpointing (it replaces it): each decoder layer keeps its input, and its backward recomputes
  K/V and then one query chunk at a time; the stand-in attention runs each chunk against its causal
  key prefix with no mask tensor, as FlashAttention does: with attn_implementation="sdpa" on CUDA a
  plainly causal batch (no padding, packing or window shorter than it) takes torch's lower-right
  causal bias, which dispatches to that kernel (not run on a GPU here); a batch with a mask builds a
  [chunk, prefix] mask per chunk and repeats K/V to all heads (HF's SDPA path), not counted here;
- MoE layers (Mixtral, Qwen3-MoE, GPT-OSS) run upstream's default `grouped_mm` experts path: each
  token's top-k copies are gathered, sorted by expert and multiplied, so the memory does not depend
  on the routing; GPT-OSS's attention sinks are assumed to be in the FlashAttention-style kernel too;
  a method whose path a family lacks (streaming on GPT-OSS) is listed as not planned, with the reason;
Left out: the CUDA context and library workspaces (cuBLAS, NCCL: typically 0.5-2 GiB),
allocator fragmentation and caching, kernels' scratch memory (e.g. FlashAttention-2's backward
allocates an fp32 dq accumulator and, with GQA, K/V gradients expanded to all heads: up to about
4x the bytes of one layer's query), and other processes. Keep a margin.
"""

import argparse
import contextlib
import functools
import json
import math
import multiprocessing
import os
import sys
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from tqdm import tqdm

import transformers
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

from ..streaming_backward import layer as streamed_layer
from ..streaming_backward import masks as streamed_masks
from ..streaming_backward import offload as streamed_offload
from ..mst_core.families import CHECKPOINTS, FAMILIES, streaming_model_types
from ..mst_core.fields import validate_streaming_backward_chunk
from ..mst_core.memory import LiveTensorTracker
from ..mst_core.model_checks import MINI_SEQUENCE_MODEL_TYPES, TEXT_CONFIG_LM_HEAD_MODEL_TYPES
from . import layer_phases


GIB = 2**30


class Method(NamedTuple):
    """The settings a planned (or benchmarked) method trains with."""

    mini_sequence_chunk: object  # None or "auto"
    checkpointing: bool  # upstream's activation_checkpointing_enable()
    streaming_backward_chunk: object = None  # None or "auto" (StreamBP; replaces checkpointing for its layers)


METHODS = {
    "vanilla": Method(None, False),
    "checkpointing": Method(None, True),
    "mini_sequence": Method("auto", False),
    "mini_sequence+checkpointing": Method("auto", True),
    "streaming": Method(None, False, "auto"),
    "mini_sequence+streaming": Method("auto", False, "auto"),
}
# per parameter; "adamw-fp32-master": DeepSpeed/Trainer bf16 mixed precision (fp32 master weights + 2 fp32 states)
OPTIMIZER_STATE_BYTES = {"adamw": 8, "adamw-bf16": 4, "adamw-fp32-master": 12, "none": 0}
ZERO_STAGES = (0, 1, 2, 3)
OFFLOAD_CHOICES = ("optimizer", "inputs")  # optimizer states / checkpointed layer inputs in host memory
MULTI_GPU_ASSUMPTIONS = """
Multi-GPU (--gpus/--zero/--sp/--offload), per GPU (rank); every figure is an estimate:
- the rank's step is measured like the one-GPU step, on its own work: with Ulysses sp it runs S/sp
  tokens through embedding, norms, MLPs and the LM-head loss, and its attention stand-in does the
  all-to-alls: it keeps q/k/v for H/sp heads (key/value: H_kv/sp, or one replicated head when
  H_kv < sp) over all S tokens, their output and log-sum-exp, plus one transient send buffer per
  all-to-all, and in backward the same for the gradients;
- states: bf16 weights, optimizer states per --optimizer. ZeRO shards over all --gpus ranks:
  ZeRO-1 keeps ceil(P/N) parameters' optimizer states, ZeRO-2 also reduce-scatters each gradient
  as soon as it is accumulated (measured in the step: the full gradient is freed and a 1/N bf16
  partition kept), ZeRO-3 also keeps only 1/N of the weights and, measured in the step, gathers
  the full parameters of one module at a time (each module with parameters of its own, like
  DeepSpeed) for its forward, its recomputation and its backward. Its hooks make the
  mini-sequence Functions take their checkpointed-chunk path, as under real ZeRO-3;
- --offload optimizer: the optimizer states (fp32 master weights included with
  adamw-fp32-master) live in host memory and the step runs there; gradients stay on the GPU as
  the ZeRO stage shards them;
- --offload inputs (with checkpointing or streaming): `activation_checkpointing_enable(offload=True)`:
  each decoder layer's checkpointed (streamed: saved) input [S/sp, d] goes to host memory in forward.
  Checkpointed layers: in backward one is on the GPU in use (whole, for the layer's whole backward)
  and one more in flight (prefetch). Streamed layers bring theirs back one query chunk at a time, as
  the library does (streaming_backward/offload.py HostStorage: the planner counts its host copies, the chunks it loads
  are allocated on the GPU); streaming is planned with sp=1 only, and not with ZeRO-3 + --offload inputs;
- left out as well: DeepSpeed's communication buckets (reduce_bucket_size, stage3 prefetch and
  max-live-parameters buffers: set them small), NCCL buffers, parameter prefetching beyond one
  module, pinned-memory staging; host memory counts only offloaded tensors (per GPU: multiply by
  the GPUs of a node for the node's total), not the processes themselves.
"""
ATTENTION = "mst_planner"  # (a name containing "flash" would send upstream looking for a kernel)


class PlanError(ValueError):
    """Bad input to the planner; the message says what is wrong and what is allowed."""


class _FlashLikeAttention(torch.autograd.Function):
    """Memory stand-in for a FlashAttention kernel: allocates its output and the log-sum-exp it
    keeps for backward, and in backward the three input gradients. The values are meaningless
    (planning runs on fake tensors); only the allocations matter."""

    @staticmethod
    def forward(ctx, query, key, value, sinks):
        out = torch.empty_like(query)
        logsumexp = query.new_empty(query.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(query, key, value, out, logsumexp)
        ctx.sinks = sinks
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, _, _ = ctx.saved_tensors
        sinks_grad = None if ctx.sinks is None else torch.empty_like(ctx.sinks)
        return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value), sinks_grad


def _flash_like_attention(module, query, key, value, attention_mask, s_aux=None, **kwargs):
    # query [B, H, S, D], key/value [B, H_kv, S, D]; HF attention functions return [B, S, H, D]. GPT-OSS passes its
    # attention sinks [H] as s_aux: a kernel with sinks returns their gradient too (the streamed layer checks it).
    return _FlashLikeAttention.apply(query, key, value, s_aux).transpose(1, 2).contiguous(), None


# Streamed layers call it per query chunk with mask=None, as FlashAttention (bottom-right causal) is called.
setattr(_flash_like_attention, streamed_masks.BOTTOM_RIGHT_CAUSAL, True)




def _send_buffer(tensor):
    """The transient contiguous copy an all-to-all sends from (allocated, then dropped at once)."""
    return torch.empty_like(tensor, memory_format=torch.contiguous_format)


class _UlyssesFlashLikeAttention(torch.autograd.Function):
    """Memory stand-in for DeepSpeed-Ulysses around a FlashAttention kernel, on one rank of `sp`.

    The rank enters with its S/sp tokens for all heads, query [B, H, S/sp, D] and key/value
    [B, H_kv, S/sp, D]. An all-to-all turns each into the whole sequence for its share of the
    heads, [B, H/sp, S, D] (key/value: H_kv/sp heads, or one replicated head when H_kv < sp);
    the kernel keeps those, its output and a [B, H/sp, S] fp32 log-sum-exp for backward; a
    second all-to-all returns the output as [B, H, S/sp, D]. Backward mirrors it: the output
    gradient goes to [B, H/sp, S, D], the kernel makes the three input gradients there, and
    all-to-alls bring them back to the rank's tokens. Each all-to-all also allocates one
    transient send buffer of its input's size. Values are meaningless; only allocations matter."""

    @staticmethod
    def forward(ctx, query, key, value, sp):
        ctx.sp, ctx.shapes = sp, (query.shape, key.shape)
        gathered = []
        for t in (query, key, value):
            b, h, s, d = t.shape
            _send_buffer(t)
            gathered.append(t.new_empty(b, max(h // sp, 1), s * sp, d))
        q, k, v = gathered
        out_heads = torch.empty_like(q)
        logsumexp = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out_heads, logsumexp)
        _send_buffer(out_heads)
        return query.new_empty(query.shape)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, _, _ = ctx.saved_tensors
        _send_buffer(grad_out)
        grad_heads = torch.empty_like(q)  # the output gradient for this rank's heads, whole sequence
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        del grad_heads  # the kernel is done with it
        query_shape, kv_shape = ctx.shapes
        grads = []
        for g, shape in ((dq, query_shape), (dk, kv_shape), (dv, kv_shape)):
            _send_buffer(g)
            grads.append(g.new_empty(shape))
        del dq, dk, dv
        return (*grads, None)


def _ulysses_attention(module, query, key, value, attention_mask, sp, **kwargs):
    return _UlyssesFlashLikeAttention.apply(query, key, value, sp).transpose(1, 2).contiguous(), None


def _attention_name(sp):
    """The planner's attention for sequence-parallel degree `sp`, registered with upstream's attention and mask
    interfaces on first use (importing the planner registers nothing)."""
    name = ATTENTION if sp == 1 else f"{ATTENTION}_ulysses{sp}"
    if name not in AttentionInterface._global_mapping:
        attention = _flash_like_attention if sp == 1 else functools.partial(_ulysses_attention, sp=sp)
        AttentionInterface.register(name, attention)
        AttentionMaskInterface.register(name, flash_attention_mask)  # no mask tensor without padding
    return name


@dataclass(frozen=True)
class Parallel:
    """How one training step is spread over GPUs (see MULTI_GPU_ASSUMPTIONS)."""

    gpus: int = 1
    zero: int = 0
    sp: int = 1
    offload: tuple = ()  # subset of OFFLOAD_CHOICES

    @property
    def single(self):
        return self == Parallel()


def check_parallel(parallel: Parallel, config, granularity: int, optimizer_in_backward: bool):
    """Raise PlanError naming the setting and what is allowed; called before any measurement."""
    gpus, zero, sp = parallel.gpus, parallel.zero, parallel.sp
    if not isinstance(gpus, int) or gpus < 1:
        raise PlanError(f"--gpus {gpus!r}: must be a positive integer")
    if zero not in ZERO_STAGES:
        raise PlanError(f"--zero {zero!r}: allowed {', '.join(map(str, ZERO_STAGES))}")
    if not isinstance(sp, int) or sp < 1 or gpus % sp:
        raise PlanError(f"--sp {sp!r}: must be a positive integer dividing --gpus {gpus} "
                        f"(allowed: {', '.join(str(n) for n in range(1, gpus + 1) if gpus % n == 0)})")
    unknown = [o for o in parallel.offload if o not in OFFLOAD_CHOICES]
    if unknown:
        raise PlanError(f"--offload {' '.join(map(str, unknown))}: allowed {', '.join(OFFLOAD_CHOICES)} (or both)")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % sp:
        raise PlanError(f"--sp {sp}: Ulysses splits the attention heads over the sp ranks, and {heads} query heads "
                        f"are not divisible by {sp} (allowed sp: divisors of {heads} that divide --gpus {gpus})")
    if kv_heads % sp and sp % kv_heads:
        raise PlanError(f"--sp {sp}: {kv_heads} key/value heads can neither be split over {sp} ranks nor "
                        f"replicated evenly (sp must divide, or be a multiple of, the key/value heads)")
    if granularity % sp:
        raise PlanError(f"--granularity {granularity}: must be a multiple of --sp {sp} (each rank holds S/sp tokens)")
    if optimizer_in_backward and zero:
        raise PlanError(f"--optimizer-in-backward with --zero {zero}: ZeRO applies the optimizer to its shards "
                        f"after the step; allowed only with --zero 0")


def _plannable(method: str, parallel: Parallel) -> bool:
    """Whether the parallel settings can plan `method` (streaming: sp 1, and not ZeRO-3 with input offload)."""
    if METHODS[method].streaming_backward_chunk is None:
        return True
    return parallel.sp == 1 and not (parallel.zero >= 3 and "inputs" in parallel.offload)


# Model types with a streaming_backward_chunk path (families.py); on any other the field is ignored, so a
# streamed plan would silently be a plain one: the planner refuses those methods for that family instead.
STREAMING_MODEL_TYPES = streaming_model_types()


def family_refusal(method: str, model_type: str):
    """Why `method` cannot be planned for `model_type` (a sentence), or None if it can."""
    settings = METHODS[method]
    if settings.streaming_backward_chunk is not None and model_type not in STREAMING_MODEL_TYPES:
        return (f"model_type {model_type!r} has no streaming_backward_chunk path (not implemented yet; "
                f"streamed families: {', '.join(STREAMING_MODEL_TYPES)})")
    if settings.mini_sequence_chunk is not None and model_type not in MINI_SEQUENCE_MODEL_TYPES:
        return f"model_type {model_type!r} has no mini_sequence_chunk path (families: {', '.join(MINI_SEQUENCE_MODEL_TYPES)})"
    return None


def check_methods(methods, parallel: Parallel):
    """Raise PlanError for an unknown method or one the parallel settings cannot plan."""
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise PlanError(f"--methods {' '.join(unknown)}: allowed {', '.join(METHODS)}")
    streamed = [m for m in methods if METHODS[m].streaming_backward_chunk is not None]
    if streamed and parallel.sp > 1:
        raise PlanError(f"--methods {' '.join(streamed)} with --sp {parallel.sp}: streaming backward is not planned "
                        f"with Ulysses sequence parallelism (allowed with --sp 1; other methods: "
                        f"{', '.join(m for m in METHODS if m not in streamed)})")
    if streamed and parallel.zero >= 3 and "inputs" in parallel.offload:
        raise PlanError(f"--methods {' '.join(streamed)} with --zero 3 --offload inputs: not planned (under ZeRO-3 the "
                        f"streamed layers run nested checkpoints, whose saved inputs this offload does not move); "
                        f"use --zero 0-2 or drop 'inputs'")


class _StepHooks:
    """Per-rank work the planner adds to a fake step for ZeRO-2/3 and layer-input offload."""

    def __init__(self, parallel):
        self.parallel = parallel
        self.grad_shards = []  # ZeRO-2/3: this rank's 1/N partition of each reduced gradient
        self.gathered_forward = None  # ZeRO-3: the full parameters of the module running forward
        self.gathered_backward = (None, None)  # ZeRO-3: (module, full parameters) of the module in backward
        self.host_bytes = 0  # layer inputs in host memory now
        self.host_peak_bytes = 0
        self.host_window_peak = 0  # since the current phase began (layer_phases.py)

    def add_host(self, nbytes):
        self.host_bytes += nbytes
        self.host_peak_bytes = max(self.host_peak_bytes, self.host_bytes)
        self.host_window_peak = max(self.host_window_peak, self.host_bytes)

    def shard_gradient(self, param):
        # ZeRO-2/3: the full gradient is reduce-scattered and freed; this rank keeps its partition.
        self.grad_shards.append(param.grad.new_empty(math.ceil(param.numel() / self.parallel.gpus)))
        param.grad = None

    def gather_for_forward(self, module, args):
        if self.gathered_backward[0] is not module:  # still gathered if its backward began (recompute)
            self.gathered_forward = _gather(module)

    def release_after_forward(self, module, args, output):
        self.gathered_forward = None
        if isinstance(output, torch.Tensor) and output.requires_grad:
            return _GatherInBackward.apply(output, self, module)
        return output

    # --offload inputs for streamed layers: stand-in for the library's streaming_backward/offload.py HostStorage. The input's
    # host copy holds no bytes here (counted as host memory until the layer's backward is done with it);
    # each chunk the backward reads back is allocated on the GPU.
    def save(self, x):
        nbytes = x.numel() * x.element_size()
        saved = _HostCopy(x.shape, x.dtype)
        self.add_host(nbytes)
        weakref.finalize(saved, self._free_host, nbytes)
        return saved

    def _free_host(self, nbytes):
        self.add_host(-nbytes)

    def load(self, saved, start, end, device):
        return torch.empty((saved.shape[0], end - start, *saved.shape[2:]), dtype=saved.dtype, device=device)


class _HostCopy:
    """What the planner's host storage keeps of a streamed layer's input: its shape and dtype."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = shape, dtype


def _gather(module):
    """A buffer of the bytes of `module`'s own parameters in full (what a ZeRO-3 all-gather fills)."""
    nbytes = sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
    return next(module.parameters(recurse=False)).new_empty(nbytes, dtype=torch.uint8)


class _GatherInBackward(torch.autograd.Function):
    """Identity; when the gradient reaches the module's output (its backward starts), the module's
    parameters are gathered again and those of the module before it in backward are released."""

    @staticmethod
    def forward(ctx, output, hooks, module):
        ctx.hooks, ctx.module = hooks, module
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad):
        hooks = ctx.hooks
        if hooks.gathered_backward[0] is not ctx.module:
            hooks.gathered_backward = (None, None)  # release first, as the previous module's backward is done
            hooks.gathered_backward = (ctx.module, _gather(ctx.module))
        return grad, None, None


class _OffloadedCheckpoint(torch.autograd.Function):
    """Gradient checkpointing of one decoder layer whose input moves to host memory in forward.

    Forward runs the layer without keeping anything on the GPU (the input [S/sp, d] goes to the
    host); backward brings it back (one buffer in use, one more in flight for the layer before:
    prefetch), recomputes the layer and backpropagates through it, parameters' gradients included."""

    @staticmethod
    def forward(ctx, hooks, run, hidden):
        ctx.hooks, ctx.run, ctx.meta = hooks, run, (hidden.shape, hidden.dtype)
        ctx.nbytes = hidden.numel() * hidden.element_size()
        hooks.add_host(ctx.nbytes)
        return run(hidden)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype = ctx.meta
        hidden = grad.new_empty(shape, dtype=dtype).requires_grad_()  # copied back from the host
        prefetch = grad.new_empty(shape, dtype=dtype)  # noqa: F841  (the previous layer's input, in flight)
        ctx.hooks.add_host(-ctx.nbytes)
        with torch.enable_grad():
            out = ctx.run(hidden)
        torch.autograd.backward(out, grad)
        return None, None, hidden.grad


def _offloaded_checkpoint(hooks, function, *args):
    """Stand-in for a layer's `_gradient_checkpointing_func`: args is (hidden_states,)."""
    if len(args) != 1 or not isinstance(args[0], torch.Tensor):
        raise PlanError("layer-input offload expects a decoder layer called with hidden_states only")
    return _OffloadedCheckpoint.apply(hooks, function, args[0])


def load_config(model: str):
    """A built-in name or a local config.json (file or checkpoint folder) of a supported family."""
    if model in CHECKPOINTS:
        model_type, values = CHECKPOINTS[model]
        return getattr(transformers, FAMILIES[model_type].config_class)(**values)
    path = Path(model)
    if not path.exists():
        raise PlanError(f"--model {model!r} is neither a built-in name ({', '.join(CHECKPOINTS)}) nor an existing config.json path")
    try:
        config = transformers.AutoConfig.from_pretrained(path.parent if path.is_file() else path)
    except (OSError, ValueError) as err:
        raise PlanError(f"--model {model}: cannot read a config.json there ({err})") from None
    if config.model_type in TEXT_CONFIG_LM_HEAD_MODEL_TYPES:  # Gemma-3: the planner plans the text stack
        config = config.get_text_config()
    if config.model_type not in MINI_SEQUENCE_MODEL_TYPES:
        raise PlanError(f"--model {model}: model_type {config.model_type!r} is not supported; "
                        f"supported: {', '.join(MINI_SEQUENCE_MODEL_TYPES + TEXT_CONFIG_LM_HEAD_MODEL_TYPES)}")
    return config


class Planner:
    def __init__(self, config, optimizer="adamw", optimizer_in_backward=False, parallel=None, granularity=1024,
                 streaming_chunk="auto"):
        if optimizer not in OPTIMIZER_STATE_BYTES:
            raise PlanError(f"--optimizer {optimizer!r}: allowed {', '.join(OPTIMIZER_STATE_BYTES)}")
        try:
            validate_streaming_backward_chunk(streaming_chunk)
        except ValueError as err:
            raise PlanError(f"--streaming-chunk {streaming_chunk!r}: {err}") from None
        if streaming_chunk is None:
            raise PlanError('--streaming-chunk None: allowed "auto" or a positive int (query tokens per chunk)')
        self.streaming_chunk = streaming_chunk  # streaming_backward_chunk of the streamed methods
        self.parallel = parallel = parallel or Parallel()
        check_parallel(parallel, config, granularity, optimizer_in_backward)
        self.config = config
        self._peaks = {}  # (method, seq_len) -> peak bytes per GPU, resident included
        self._host = {}  # (method, seq_len) -> host bytes per GPU (offloaded layer inputs at their peak)
        self.progress = None  # a tqdm bar: one tick per fake step, its postfix names the step running
        self.optimizer = optimizer
        self.optimizer_in_backward = optimizer_in_backward
        with FakeTensorMode():
            model = self._build(METHODS["vanilla"])[0]
            self.num_params = sum(p.numel() for p in model.parameters())
            self.layer_period = self._layer_period(model)
        # Weights (bf16) and optimizer states exist before a step; gradients are counted in it.
        # Per GPU: ZeRO-1 keeps 1/N of the optimizer states, ZeRO-3 also 1/N of the weights (its
        # gathered working set is measured in the step, as are gradients: ZeRO-2/3 shard them there).
        n = parallel.gpus
        weights = 2 * (math.ceil(self.num_params / n) if parallel.zero >= 3 else self.num_params)
        states = OPTIMIZER_STATE_BYTES[optimizer] * (math.ceil(self.num_params / n) if parallel.zero >= 1 else self.num_params)
        self.host_state_bytes = states if "optimizer" in parallel.offload else 0
        self.resident_bytes = weights + states - self.host_state_bytes
        # Gradients per GPU when all exist at once (for the "cannot hold even the weights" check).
        self.gradient_bytes = 0 if optimizer_in_backward else 2 * (
            math.ceil(self.num_params / n) if parallel.zero >= 2 else self.num_params)

    def _layer_period(self, model):
        """The period of the stack's layer kinds, if a shallower stack of them can stand in for it (layer_phases.py:
        the same layers in the same order, the hooks' modules present); else None (every step runs every layer)."""
        stack = _decoder_stack(model)
        if stack is None:
            return None
        signatures = _layer_signatures(model.config, stack[0])
        period = layer_phases.layer_period(signatures)
        shallow = layer_phases.shallow_depth(len(signatures), period)
        if shallow is None:
            return None
        shallow_stack = _decoder_stack(self._build(METHODS["vanilla"], shallow)[0])
        if shallow_stack is None or _layer_signatures(model.config, shallow_stack[0]) != signatures[:shallow]:
            return None
        return period

    def _build(self, method: Method, depth=None):
        """The model `method` trains, with `depth` decoder layers instead of the config's if given (the same
        layer kinds in the same order: `layer_types` cut to it)."""
        # use_cache=False: training keeps no KV cache (checkpointing would turn it off with a warning).
        overrides = {"mini_sequence_chunk": method.mini_sequence_chunk, "use_cache": False,
                     "streaming_backward_chunk": None if method.streaming_backward_chunk is None else self.streaming_chunk}
        if depth is not None:
            overrides["num_hidden_layers"] = depth
            if getattr(self.config, "layer_types", None) is not None:
                overrides["layer_types"] = list(self.config.layer_types[:depth])
        config = self.config.__class__(**{**self.config.to_dict(), **overrides})
        config._attn_implementation = _attention_name(self.parallel.sp)
        # bf16 whatever dtype the config.json names (from_config would otherwise follow config.dtype).
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.train()
        checkpointing = method.checkpointing
        if checkpointing:  # 5.x name of gradient_checkpointing_enable(); non-reentrant by default
            model.activation_checkpointing_enable()
        if self.optimizer_in_backward:
            for p in model.parameters():  # applied, then freed, as soon as it is accumulated
                p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
        hooks = _StepHooks(self.parallel)
        if self.parallel.zero >= 2:
            for p in model.parameters():
                p.register_post_accumulate_grad_hook(hooks.shard_gradient)
        if self.parallel.zero >= 3:  # like DeepSpeed: every module with parameters of its own
            for module in model.modules():
                if next(module.parameters(recurse=False), None) is not None:
                    module.register_forward_pre_hook(hooks.gather_for_forward)
                    module.register_forward_hook(hooks.release_after_forward)
        if method.streaming_backward_chunk is not None and "inputs" in self.parallel.offload:
            # What a user does: checkpointing with offload, which streaming replaces and honours (HostStorage).
            model.activation_checkpointing_enable(offload=True)
            for layer in model.modules():  # the streamed layers keep their inputs in the stand-in (offload.py)
                if getattr(layer, "gradient_checkpointing", False):
                    layer._gradient_checkpointing_func.offload = hooks
            if not any(streamed_layer.applies(m) and streamed_offload.offload_requested(m) for m in model.modules()):
                raise PlanError(f"{type(model).__name__}: no streamed decoder layers found for --offload inputs")
        elif checkpointing and "inputs" in self.parallel.offload:
            layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False)]
            if not layers:
                raise PlanError(f"{type(model).__name__}: no checkpointed decoder layers found for --offload inputs")
            for layer in layers:
                layer._gradient_checkpointing_func = functools.partial(_offloaded_checkpoint, hooks)
        return model, hooks

    def step_peak_bytes(self, method, seq_len, fake=True, shallow=True):
        """Peak live bytes allocated on one GPU by one forward + backward at `seq_len` tokens (the
        rank runs seq_len / sp of them; fake tensors unless fake=False, which runs the same step
        for real: the tests compare the two). With `shallow` (fake steps only), a stack of a few
        layers is run and the full stack's phases are walked from its own (layer_phases.py: the
        same bytes; the tests compare the two); without, every layer runs."""
        check_methods([method], self.parallel)
        refusal = family_refusal(method, self.config.model_type)
        if refusal:
            raise PlanError(f"{method}: not planned: {refusal}")
        depth = self.config.num_hidden_layers
        if shallow and fake and self.layer_period is not None:
            period = self.layer_period
            shallow_depth = layer_phases.shallow_depth(depth, period)
            phases = self._step(method, seq_len, fake, shallow_depth)[2]
            deep = layer_phases.deepened(phases, period, (depth - shallow_depth) // period)
            if deep is not None:
                peak, self._host[(method, seq_len)] = layer_phases.walk(deep)
                return peak
        peak, self._host[(method, seq_len)], _ = self._step(method, seq_len, fake)
        return peak

    def _step(self, method, seq_len, fake, depth=None):
        """(peak bytes, peak host bytes, the phases when `depth` is given) of one step (step_peak_bytes)."""
        with FakeTensorMode() if fake else contextlib.nullcontext():
            model, hooks = self._build(METHODS[method], depth)
            ids = torch.zeros(1, seq_len // self.parallel.sp, dtype=torch.long)
            with LiveTensorTracker(keep_largest=0) as tracker:
                recorder = None if depth is None else layer_phases.PhaseRecorder(tracker, hooks, *_decoder_stack(model))
                model(input_ids=ids, labels=ids).loss.backward()
                phases = None if recorder is None else recorder.finish()
        if phases is not None and layer_phases.walk(phases) != (tracker.peak_bytes, hooks.host_peak_bytes):
            raise RuntimeError(f"planner: the phases of a {depth}-layer step do not add up to its peak "
                               f"({layer_phases.walk(phases)} != {(tracker.peak_bytes, hooks.host_peak_bytes)})")
        return tracker.peak_bytes, hooks.host_peak_bytes, phases

    def peak_bytes(self, method, seq_len):
        """Resident bytes + the step's peak at `seq_len` (memoized: each new value is a fake step)."""
        key = (method, seq_len)
        if key not in self._peaks:
            if self.progress is not None:
                self.progress.set_postfix_str(f"{method} at {seq_len} tokens")
            self._peaks[key] = self.resident_bytes + self.step_peak_bytes(method, seq_len)
            if self.progress is not None:
                self.progress.update()
        return self._peaks[key]

    def host_bytes(self, method, seq_len):
        """Host memory per GPU: offloaded optimizer states + offloaded layer inputs at their peak."""
        self.peak_bytes(method, seq_len)
        return self.host_state_bytes + self._host[(method, seq_len)]

    def max_seq_len(self, method, budget_bytes, granularity=1024, limit=1 << 22):
        """Largest multiple of `granularity` (<= `limit` tokens per rank, i.e. limit * sp in all)
        whose peak fits; 0 if not even one fits."""
        return search_max_fitting(lambda s: self.peak_bytes(method, s), budget_bytes, granularity,
                                  limit * self.parallel.sp)


def _decoder_stack(model):
    """(decoder layers, final norm) of a causal LM, or None where they are not where the families keep them."""
    decoder = getattr(model, "model", None)
    layers, norm = getattr(decoder, "layers", None), getattr(decoder, "norm", None)
    if not isinstance(layers, torch.nn.ModuleList) or not isinstance(norm, torch.nn.Module) or not len(layers):
        return None
    return layers, norm


def _layer_signatures(config, layers):
    """What makes two decoder layers alike for the planner: their class, their submodules' classes (a dense MLP or
    a MoE block), their entry in `layer_types` (sliding or full attention) and their attention's window."""
    layer_types = getattr(config, "layer_types", None) or [None] * len(layers)
    return [(type(layer).__name__, tuple((name, type(child).__name__) for name, child in layer.named_children()),
             layer_types[index], getattr(getattr(layer, "self_attn", None), "sliding_window", None))
            for index, layer in enumerate(layers)]


def search_max_fitting(peak, budget, granularity, limit):
    """Largest multiple S of `granularity`, S <= `limit`, with peak(S) <= budget (peak increasing in S).

    The peak is piecewise linear in S (no S x S tensor; the LM-head chunk policy adds a kink), so a
    secant search finds the boundary in a few calls: extrapolate through the last two measured
    points until one does not fit, then interpolate between the ends of the bracket
    [fits, does not fit], with a bisection step whenever an interpolation did not halve it. An extrapolation
    goes at most 4x beyond the longest length measured.
    The answer rests only on measured values of peak, never on an extrapolated one.
    """
    g = granularity
    limit = max(limit // g * g, g)
    if peak(g) > budget:
        return 0
    lo, hi = g, None  # lo fits; hi does not (None until one is found)
    prev, s = g, min(4 * g, limit)
    bisect_next, width = False, None
    while True:
        if peak(s) <= budget:
            lo = max(lo, s)
        else:
            hi = s if hi is None else min(hi, s)
        if lo == limit or (hi is not None and hi - lo <= g):
            return lo
        if hi is None:  # no upper end yet: extrapolate through the two latest points
            a, b = prev, s
        else:  # interpolate between the bracket's ends
            a, b = lo, hi
            # bisect if the previous interpolation did not at least halve the bracket
            bisect_next = width is not None and not bisect_next and (hi - lo) > width // 2
            width = hi - lo
        slope = (peak(b) - peak(a)) / (b - a)
        if hi is not None and (bisect_next or slope <= 0):
            guess = (lo + hi) // 2 // g * g
        elif slope <= 0:  # flat so far: grow
            guess = 2 * lo
        else:
            guess = int(a + (budget - peak(a)) / slope) // g * g
            if hi is None:
                # At most 4x the longest length measured: at short lengths a flat stretch (the kept gradients
                # dominate the peak until the LM head's logits do) would send the secant millions of tokens out,
                # to a fake step that takes minutes.
                guess = min(guess, 4 * s)
        upper = limit if hi is None else hi - g
        prev, s = s, min(max(guess, lo + g), upper)


def plan(model, gpu_memory_gib, optimizer="adamw", optimizer_in_backward=False, granularity=1024,
         gpus=1, zero=0, sp=1, offload=(), methods=None, streaming_chunk="auto", seq_lens=None, progress=False,
         jobs=1):
    """Search each method's longest fitting sequence, or with `seq_lens` evaluate those lengths only.
    `progress`: show a bar of the fake steps on stderr (the command line does). `jobs` > 1: the methods'
    searches run in that many forked processes (each search is independent: the same steps, the same numbers)."""
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise PlanError(f"--jobs {jobs!r}: allowed a positive number of processes")
    parallel = Parallel(gpus, zero, sp, tuple(offload))
    for seq in seq_lens or ():
        if isinstance(seq, bool) or not isinstance(seq, int) or seq <= 0 or seq % sp:
            raise PlanError(f"--seq-len {seq!r}: allowed positive whole-sequence token counts divisible by --sp {sp}")
    if methods is None:  # every method these settings can plan
        methods = [m for m in METHODS if _plannable(m, parallel)]
    methods = list(methods)
    check_methods(methods, parallel)
    config = load_config(model)
    not_planned = {m: family_refusal(m, config.model_type) for m in methods if family_refusal(m, config.model_type)}
    if len(not_planned) == len(methods):
        raise PlanError(f"--model {model}: none of the methods can be planned for this family: "
                        + "; ".join(f"{m}: {why}" for m, why in not_planned.items()))
    methods = [m for m in methods if m not in not_planned]
    if gpu_memory_gib <= 0:
        raise PlanError(f"--gpu-memory-gib must be positive, got {gpu_memory_gib}")
    if granularity <= 0:
        raise PlanError(f"--granularity must be a positive number of tokens, got {granularity}")
    planner = Planner(config, optimizer, optimizer_in_backward, parallel, granularity, streaming_chunk)
    budget = int(gpu_memory_gib * GIB)
    state = planner.resident_bytes + planner.gradient_bytes
    settings = f"--optimizer {optimizer}{' --optimizer-in-backward' if optimizer_in_backward else ''}"
    if not parallel.single:
        settings += (f" --gpus {gpus} --zero {zero} --sp {sp}"
                     + (f" --offload {' '.join(parallel.offload)}" if parallel.offload else ""))
    if state > budget:
        raise PlanError(
            f"{gpu_memory_gib} GiB cannot hold even the weights, gradients and optimizer states of {model} "
            f"({planner.num_params / 1e9:.2f}B parameters: {state / GIB:.1f} GiB{' per GPU' if gpus > 1 else ''} "
            f"with {settings})"
        )
    result = {"model": model, "parameters": planner.num_params, "gpu_memory_gib": gpu_memory_gib,
              "optimizer": optimizer, "optimizer_in_backward": optimizer_in_backward,
              "streaming_chunk": streaming_chunk,
              "resident_gib": round(planner.resident_bytes / GIB, 2), "granularity": granularity,
              "measured_on": "FakeTensorMode on the CPU device, standing in for the GPU (a fake cuda device "
                             "crashes the CPU build of torch)",
              "max_seq_len": {}, "peak_gib_at_max": {},
              "not_planned": not_planned}  # method -> why this family cannot plan it (reported, not dropped)
    if not parallel.single:
        result.update(gpus=gpus, zero=zero, sp=sp, offload=list(parallel.offload),
                      host_state_gib=round(planner.host_state_bytes / GIB, 2), host_gib_at_max={})
    with tqdm(desc=f"{model}: fake training steps", unit="step", file=sys.stderr, disable=not progress,
              mininterval=0.5) as planner.progress:
        if jobs > 1 and not seq_lens and len(methods) > 1:
            _search_in_processes(planner, methods, budget, granularity, jobs)
        return _measure(result, planner, methods, seq_lens, budget, granularity, parallel, gpu_memory_gib, model, state)


class _QueueProgress:
    """A worker's stand-in for the tqdm bar: sends its updates to the parent, which shows them."""

    def __init__(self, events):
        self.events = events

    def set_postfix_str(self, text):
        self.events.put(("postfix", text))

    def update(self):
        self.events.put(("update", None))


_WORKER = None  # (planner, budget, granularity, events): set before forking, read by the workers


def _search_worker(method):
    planner, budget, granularity, events = _WORKER
    planner.progress = _QueueProgress(events)
    planner.max_seq_len(method, budget, granularity)
    return ({k: v for k, v in planner._peaks.items() if k[0] == method},
            {k: v for k, v in planner._host.items() if k[0] == method})


# The methods by how long their search takes (llama3-8b: about 61, 21, 7, 6, 2 and 1 s in one process).
SLOWEST_SEARCHES_FIRST = ("mini_sequence+streaming", "mini_sequence+checkpointing", "mini_sequence", "streaming",
                          "checkpointing", "vanilla")


def _search_in_processes(planner, methods, budget, granularity, jobs):
    """Each method's search in a forked worker; their fake steps' peaks come back into `planner`'s memo,
    so `_measure` then reads every answer without another step."""
    global _WORKER
    context = multiprocessing.get_context("fork")
    events = context.SimpleQueue()
    bar, _WORKER = planner.progress, (planner, budget, granularity, events)
    try:
        with context.Pool(min(jobs, len(methods))) as pool:
            # The longest searches first, one method per task: the others fill the remaining workers meanwhile.
            longest_first = sorted(methods, key=lambda m: SLOWEST_SEARCHES_FIRST.index(m))
            pending = pool.map_async(_search_worker, longest_first, chunksize=1)
            while not (pending.ready() and events.empty()):
                if events.empty():
                    pending.wait(0.2)
                    continue
                kind, text = events.get()
                if kind == "postfix":
                    bar.set_postfix_str(text)
                else:
                    bar.update()
            for peaks, host in pending.get():
                planner._peaks.update(peaks)
                planner._host.update(host)
    finally:
        _WORKER = None


def _measure(result, planner, methods, seq_lens, budget, granularity, parallel, gpu_memory_gib, model, state):
    """plan()'s measurements: the given lengths, or each method's search."""
    if seq_lens:
        result.update(points=[], max_seq_len=None, peak_gib_at_max=None)
        for method in methods:
            for seq in seq_lens:
                peak = planner.peak_bytes(method, seq)
                result["points"].append({"method": method, "seq_len": seq, "peak_gib": round(peak / GIB, 2),
                                         "host_gib": round(planner.host_bytes(method, seq) / GIB, 2),
                                         "fits": peak <= budget})
        return _with_assumptions(result, parallel)
    for method in methods:
        seq = planner.max_seq_len(method, budget, granularity)
        result["max_seq_len"][method] = seq
        result["peak_gib_at_max"][method] = round(planner.peak_bytes(method, seq) / GIB, 2) if seq else None
        if not parallel.single:
            result["host_gib_at_max"][method] = round(planner.host_bytes(method, seq) / GIB, 2) if seq else None
    if not any(result["max_seq_len"].values()):
        raise PlanError(
            f"{gpu_memory_gib} GiB holds the weights, gradients and optimizer states of {model} "
            f"({state / GIB:.1f} GiB) but no method fits even {granularity} tokens"
        )
    return _with_assumptions(result, parallel)


def _with_assumptions(result, parallel):
    result["assumptions"] = __doc__.split("Assumptions (printed with every result):\n")[1].strip()
    if not parallel.single:
        result["assumptions"] += "\n" + MULTI_GPU_ASSUMPTIONS.strip()
    return result


def _streaming_chunk_arg(value):
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f'{value!r}: allowed "auto" or a positive int') from None


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m transformers.mst_planner.plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help=f"{', '.join(CHECKPOINTS)}, or a local config.json path")
    parser.add_argument("--gpu-memory-gib", type=float, required=True, help="memory of each GPU")
    parser.add_argument("--optimizer", default="adamw", choices=list(OPTIMIZER_STATE_BYTES))
    parser.add_argument("--optimizer-in-backward", action="store_true")
    parser.add_argument("--granularity", type=int, default=1024, help="sequence lengths searched are multiples of this")
    parser.add_argument("--gpus", type=int, default=1, help="GPUs (ranks) in the run; ZeRO shards over all of them")
    parser.add_argument("--zero", type=int, default=0, choices=ZERO_STAGES,
                        help="ZeRO stage: 1 shards optimizer states, 2 also gradients, 3 also parameters")
    parser.add_argument("--sp", type=int, default=1, help="Ulysses sequence-parallel degree (divides --gpus and the heads)")
    parser.add_argument("--offload", nargs="+", default=[], choices=OFFLOAD_CHOICES,
                        help="keep in host memory: optimizer states, checkpointed layer inputs, or both")
    parser.add_argument("--methods", nargs="+", default=None, choices=list(METHODS),
                        help="plan only these methods (default: all; each long search costs minutes)")
    parser.add_argument("--streaming-chunk", default="auto", type=_streaming_chunk_arg,
                        help='streaming_backward_chunk of the streamed methods: "auto" (default) or query tokens per chunk')
    parser.add_argument("--seq-len", nargs="+", type=int, default=None, metavar="TOKENS",
                        help="evaluate these whole-sequence lengths (peak, host memory, fits?) instead of searching")
    parser.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)),
                        help="search the methods in this many processes (default: the CPU cores this process may "
                             "use); the same results with any number")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    try:
        result = plan(args.model, args.gpu_memory_gib, args.optimizer, args.optimizer_in_backward, args.granularity,
                      args.gpus, args.zero, args.sp, args.offload, args.methods, args.streaming_chunk, args.seq_len,
                      progress=True, jobs=args.jobs)
    except PlanError as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    if args.json:
        print(json.dumps(result))
        return
    multi = "gpus" in result
    print(f"{args.model}: {result['parameters'] / 1e9:.2f}B parameters, {args.gpu_memory_gib} GiB"
          f"{' per GPU' if multi else ''}, optimizer "
          f"{args.optimizer}{' in backward' if args.optimizer_in_backward else ''}; weights + optimizer states "
          f"{result['resident_gib']} GiB{' per GPU' if multi else ''} (fake-tensor estimate on CPU)")
    if multi:
        print(f"{args.gpus} GPUs, ZeRO-{args.zero}, Ulysses sp={args.sp}, offload: "
              f"{' + '.join(result['offload']) or 'none'}; host memory per GPU holds {result['host_state_gib']} GiB "
              f"of optimizer states before layer inputs; sequence lengths are the whole sequence "
              f"(each GPU of an sp group runs 1/{args.sp} of it)")
    print()
    if args.seq_len:
        _print_points(result["points"])
    else:
        _print_maxima(result, args.granularity, multi)
    for method, why in result["not_planned"].items():
        print(f"{method:<30}not planned: {why}")
    print("\nAssumptions:\n" + result["assumptions"])


def _print_points(points):
    print(f"{'method':<30}{'seq len':>12}{'peak/GPU (GiB)':>16}{'host/GPU (GiB)':>16}{'fits':>6}")
    for point in points:
        print(f"{point['method']:<30}{point['seq_len']:>12}{point['peak_gib']:>16}{point['host_gib']:>16}"
              f"{'yes' if point['fits'] else 'no':>6}")


def _print_maxima(result, granularity, multi):
    host_header = f"{'host/GPU (GiB)':>16}" if multi else ""
    print(f"{'method':<30}{'max seq len':>12}{'peak/GPU (GiB)' if multi else 'peak (GiB)':>{16 if multi else 12}}{host_header}")
    for method, seq in result["max_seq_len"].items():
        peak = result["peak_gib_at_max"][method]
        shown = seq if seq else f"< {granularity}"  # 0: not even one granule fits
        line = f"{method:<30}{shown:>12}{peak if peak is not None else '-':>{16 if multi else 12}}"
        if multi:
            host = result["host_gib_at_max"][method]
            line += f"{host if host is not None else '-':>16}"
        print(line)


if __name__ == "__main__":
    sys.exit(main())

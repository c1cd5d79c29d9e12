"""How long a sequence fits on a GPU? Estimated on a CPU, without weights.

    python -m transformers.mini_sequence.plan --model llama3-8b --gpu-memory-gib 80 [--json]

For each method (vanilla, checkpointing, mini_sequence, mini_sequence+checkpointing) it runs
one training step (forward + backward) of the full-size model under `FakeTensorMode` on the
CPU device (tensors have shapes and dtypes but no memory; a fake `cuda` device crashes the
CPU build of torch, so fake CPU stands in for the GPU), measures the peak of live tensor bytes
with `LiveTensorTracker`, adds the resident weights and optimizer states, and searches the
largest sequence length (a multiple of --granularity) whose peak fits in the GPU memory.

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
  `activation_checkpointing_enable()` (5.x name of `gradient_checkpointing_enable`; non-reentrant).
Left out: the CUDA context and library workspaces (cuBLAS, NCCL: typically 0.5-2 GiB),
allocator fragmentation and caching, kernels' scratch memory (e.g. FlashAttention-2's backward
allocates an fp32 dq accumulator and, with GQA, K/V gradients expanded to all heads: up to about
4x the bytes of one layer's query), and other processes. Keep a margin.
"""

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import transformers
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

from .memory import LiveTensorTracker
from .support import SUPPORTED_MODEL_TYPES


GIB = 2**30
METHODS = {  # name -> (mini_sequence_chunk, gradient checkpointing)
    "vanilla": (None, False),
    "checkpointing": (None, True),
    "mini_sequence": ("auto", False),
    "mini_sequence+checkpointing": ("auto", True),
}
OPTIMIZER_STATE_BYTES = {"adamw": 8, "adamw-bf16": 4, "none": 0}  # per parameter
# Public config.json values of the released checkpoints.
BUILTIN = {
    "llama3-8b": ("LlamaConfig", dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                      num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0)),
    "llama2-7b": ("LlamaConfig", dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                      num_attention_heads=32, num_key_value_heads=32)),
    "qwen2-7b": ("Qwen2Config", dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                     num_attention_heads=28, num_key_value_heads=4)),
    "mistral-7b": ("MistralConfig", dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                         num_attention_heads=32, num_key_value_heads=8, sliding_window=4096)),
    "gemma2-9b": ("Gemma2Config", dict(vocab_size=256000, hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
                                       num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                                       query_pre_attn_scalar=256, sliding_window=4096, final_logit_softcapping=30.0,
                                       attn_logit_softcapping=50.0, tie_word_embeddings=True)),
}
ATTENTION = "mst_planner"  # (a name containing "flash" would send upstream looking for a kernel)


class PlanError(ValueError):
    """Bad input to the planner; the message says what is wrong and what is allowed."""


class _FlashLikeAttention(torch.autograd.Function):
    """Memory stand-in for a FlashAttention kernel: allocates its output and the log-sum-exp it
    keeps for backward, and in backward the three input gradients. The values are meaningless
    (planning runs on fake tensors); only the allocations matter."""

    @staticmethod
    def forward(ctx, query, key, value):
        out = torch.empty_like(query)
        logsumexp = query.new_empty(query.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(query, key, value, out, logsumexp)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, _, _ = ctx.saved_tensors
        return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _flash_like_attention(module, query, key, value, attention_mask, **kwargs):
    # query [B, H, S, D], key/value [B, H_kv, S, D]; HF attention functions return [B, S, H, D].
    return _FlashLikeAttention.apply(query, key, value).transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, _flash_like_attention)
AttentionMaskInterface.register(ATTENTION, flash_attention_mask)  # no mask tensor without padding


def load_config(model: str):
    """A built-in name or a local config.json (file or checkpoint folder) of a supported family."""
    if model in BUILTIN:
        class_name, values = BUILTIN[model]
        return getattr(transformers, class_name)(**values)
    path = Path(model)
    if not path.exists():
        raise PlanError(f"--model {model!r} is neither a built-in name ({', '.join(BUILTIN)}) nor an existing config.json path")
    try:
        config = transformers.AutoConfig.from_pretrained(path.parent if path.is_file() else path)
    except (OSError, ValueError) as err:
        raise PlanError(f"--model {model}: cannot read a config.json there ({err})") from None
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise PlanError(f"--model {model}: model_type {config.model_type!r} is not supported; "
                        f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    return config


class Planner:
    def __init__(self, config, optimizer="adamw", optimizer_in_backward=False):
        if optimizer not in OPTIMIZER_STATE_BYTES:
            raise PlanError(f"--optimizer {optimizer!r}: allowed {', '.join(OPTIMIZER_STATE_BYTES)}")
        self.config = config
        self._peaks = {}  # (method, seq_len) -> peak bytes, resident included
        self.optimizer = optimizer
        self.optimizer_in_backward = optimizer_in_backward
        with FakeTensorMode():
            self.num_params = sum(p.numel() for p in self._build(None, False).parameters())
        # Weights (bf16) and optimizer states exist before a step; gradients are counted in it.
        self.resident_bytes = self.num_params * (2 + OPTIMIZER_STATE_BYTES[optimizer])

    def _build(self, chunk, checkpointing):
        # use_cache=False: training keeps no KV cache (checkpointing would turn it off with a warning).
        config = self.config.__class__(**{**self.config.to_dict(), "mini_sequence_chunk": chunk, "use_cache": False})
        config._attn_implementation = ATTENTION
        # bf16 whatever dtype the config.json names (from_config would otherwise follow config.dtype).
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.train()
        if checkpointing:  # 5.x name of gradient_checkpointing_enable(); non-reentrant by default
            model.activation_checkpointing_enable()
        if self.optimizer_in_backward:
            for p in model.parameters():  # applied, then freed, as soon as it is accumulated
                p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
        return model

    def step_peak_bytes(self, method, seq_len, fake=True):
        """Peak live bytes allocated by one forward + backward at `seq_len` (fake tensors unless
        fake=False, which runs the same step for real: the tests compare the two)."""
        chunk, checkpointing = METHODS[method]
        with FakeTensorMode() if fake else contextlib.nullcontext():
            model = self._build(chunk, checkpointing)
            ids = torch.zeros(1, seq_len, dtype=torch.long)
            with LiveTensorTracker(keep_largest=0) as tracker:
                model(input_ids=ids, labels=ids).loss.backward()
        return tracker.peak_bytes

    def peak_bytes(self, method, seq_len):
        """Resident bytes + the step's peak at `seq_len` (memoized: each new value is a fake step)."""
        key = (method, seq_len)
        if key not in self._peaks:
            self._peaks[key] = self.resident_bytes + self.step_peak_bytes(method, seq_len)
        return self._peaks[key]

    def max_seq_len(self, method, budget_bytes, granularity=1024, limit=1 << 22):
        """Largest multiple of `granularity` (<= `limit`) whose peak fits; 0 if not even one fits."""
        return search_max_fitting(lambda s: self.peak_bytes(method, s), budget_bytes, granularity, limit)


def search_max_fitting(peak, budget, granularity, limit):
    """Largest multiple S of `granularity`, S <= `limit`, with peak(S) <= budget (peak increasing in S).

    The peak is piecewise linear in S (no S x S tensor; the LM-head chunk policy adds a kink), so a
    secant search finds the boundary in a few calls: extrapolate through the last two measured
    points until one does not fit, then interpolate between the ends of the bracket
    [fits, does not fit], with a bisection step whenever an interpolation did not halve it.
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
        upper = limit if hi is None else hi - g
        prev, s = s, min(max(guess, lo + g), upper)


def plan(model, gpu_memory_gib, optimizer="adamw", optimizer_in_backward=False, granularity=1024):
    config = load_config(model)
    if gpu_memory_gib <= 0:
        raise PlanError(f"--gpu-memory-gib must be positive, got {gpu_memory_gib}")
    if granularity <= 0:
        raise PlanError(f"--granularity must be a positive number of tokens, got {granularity}")
    planner = Planner(config, optimizer, optimizer_in_backward)
    budget = int(gpu_memory_gib * GIB)
    gradients = 0 if optimizer_in_backward else 2 * planner.num_params
    if planner.resident_bytes + gradients > budget:
        raise PlanError(
            f"{gpu_memory_gib} GiB cannot hold even the weights, gradients and optimizer states of {model} "
            f"({planner.num_params / 1e9:.2f}B parameters: {(planner.resident_bytes + gradients) / GIB:.1f} GiB "
            f"with --optimizer {optimizer}{' --optimizer-in-backward' if optimizer_in_backward else ''})"
        )
    result = {"model": model, "parameters": planner.num_params, "gpu_memory_gib": gpu_memory_gib,
              "optimizer": optimizer, "optimizer_in_backward": optimizer_in_backward,
              "resident_gib": round(planner.resident_bytes / GIB, 2), "granularity": granularity,
              "measured_on": "FakeTensorMode on the CPU device, standing in for the GPU (a fake cuda device "
                             "crashes the CPU build of torch)",
              "max_seq_len": {}, "peak_gib_at_max": {}}
    for method in METHODS:
        seq = planner.max_seq_len(method, budget, granularity)
        result["max_seq_len"][method] = seq
        result["peak_gib_at_max"][method] = round(planner.peak_bytes(method, seq) / GIB, 2) if seq else None
    if not any(result["max_seq_len"].values()):
        raise PlanError(
            f"{gpu_memory_gib} GiB holds the weights, gradients and optimizer states of {model} "
            f"({(planner.resident_bytes + gradients) / GIB:.1f} GiB) but no method fits even {granularity} tokens"
        )
    result["assumptions"] = __doc__.split("Assumptions (printed with every result):\n")[1].strip()
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m transformers.mini_sequence.plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help=f"{', '.join(BUILTIN)}, or a local config.json path")
    parser.add_argument("--gpu-memory-gib", type=float, required=True)
    parser.add_argument("--optimizer", default="adamw", choices=list(OPTIMIZER_STATE_BYTES))
    parser.add_argument("--optimizer-in-backward", action="store_true")
    parser.add_argument("--granularity", type=int, default=1024, help="sequence lengths searched are multiples of this")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    try:
        result = plan(args.model, args.gpu_memory_gib, args.optimizer, args.optimizer_in_backward, args.granularity)
    except PlanError as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    if args.json:
        print(json.dumps(result))
        return
    print(f"{args.model}: {result['parameters'] / 1e9:.2f}B parameters, {args.gpu_memory_gib} GiB, optimizer "
          f"{args.optimizer}{' in backward' if args.optimizer_in_backward else ''}; weights + optimizer states "
          f"{result['resident_gib']} GiB (fake-tensor estimate on CPU)\n")
    print(f"{'method':<30}{'max seq len':>12}{'peak (GiB)':>12}")
    for method, seq in result["max_seq_len"].items():
        peak = result["peak_gib_at_max"][method]
        shown = seq if seq else f"< {args.granularity}"  # 0: not even one granule fits
        print(f"{method:<30}{shown:>12}{peak if peak is not None else '-':>12}")
    print("\nAssumptions:\n" + result["assumptions"])


if __name__ == "__main__":
    sys.exit(main())

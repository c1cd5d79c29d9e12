"""Mini-sequence LM head + causal-LM loss (MsT Algorithms 2 and 4).

Same semantics as upstream ``ForCausalLMLoss(lm_head(hidden_states), labels, ...)`` (with
Gemma-2's optional final-logit soft-capping in between), without ever allocating a
[N, V] tensor: no full logits, no fp32 copy of them, no full logits gradient.

Design: a custom autograd Function that, when a gradient is needed, computes in its forward,
chunk by chunk, the fp32 loss sum AND its gradients with respect to the chunk's hidden states
and the LM head's parameters. Backward then only scales the stored gradients by the incoming
gradient. Compared with recomputing the logits in backward this saves one [C, d] x [d, V]
matmul per chunk (the forward logits), and it does not raise the peak: the stored [N, d]
hidden gradient and the parameter gradient would exist in backward anyway, and nothing runs
between the LM head's forward and its backward.

Per chunk: ``lm_head(chunk)`` (the module itself, under autograd), then the loss and its logits
gradient computed by hand a few rows at a time in fp32 (as upstream's cross-entropy backward
computes it) and written, rounded once to the logits' dtype, over the logits themselves; then
``autograd.grad`` of the logits with that gradient for the hidden states and any other
parameter. The weight of a plain ``nn.Linear`` head gets its gradient summed straight into the
accumulator: on CUDA by one GEMM with an fp32 output per chunk (no half-precision product at all), elsewhere
an eighth of the rows at a time (`mst_core/grads.py: add_linear_weight_grad`). So a bf16 chunk holds one [C, V] bf16 buffer,
not the bf16 logits + an fp32 copy + the fp32 log-probabilities + the fp32 and bf16 gradients,
and no [V, d] gradient per chunk next to the fp32 accumulator. Half-precision parameter
gradients are still summed in fp32 and rounded once (mlp.py): the fp32 [V, d] accumulator stays,
as a bf16 running sum would double the weight gradient's error.

Measured with ``scripts/lm_head_memory.py --fake-peaks --time-tokens 1024``
(CPU, 2 AVX2 cores; 8192 tokens, d=512, V=32000, "auto" chunk 1024; forward+backward of head +
loss; peak = live tensor bytes, bf16 peaks under FakeTensorMode, checked equal to real ones on a
small shape; time at 1024 tokens, one chunk, median of 2, interleaved)::

    case         chunk  peak MiB  peak/fp32   time s  time/fp32
    fp32 path     1024     157.0       1.00     1.59       1.00   (F.linear_cross_entropy)
    bf16 before   1024     476.8       3.04    61.62      38.69
    bf16 after    1024     148.9       0.95    56.22      35.30

    bf16 after/before: peak 0.31, time 0.91 (steps: before 64.1 / 59.2 s, after 56.5 / 56.0 s).
    Two other runs: 0.92 (quiet) and 1.21 (its first pair of steps ran next to a test suite;
    the second pair alone: 1.01). The "auto" chunk policy is unchanged (1024 tokens here).

Gradients: the same accuracy as before against fp64 (tests/test_mini_sequence_core.py, seeds
0-7: hidden-state gradient 1.000x upstream bf16's error, weight gradient 1.21-1.33x, both
unchanged). The time is the bf16 matmuls (this CPU has no bf16 instructions: 35x the fp32 path);
the sliced weight gradient is cheaper there than one [V, C] x [C, d] bf16 matmul.

torch 2.13's chunked ``F.linear_cross_entropy(..., options=LinearCrossEntropyOptions())``
was measured against this on the same shapes (CPU, 2 cores, 1 x 2048 tokens, d=256,
V=16384, chunk 64 = ceil(N / ceil(V/d)), 300 ignored labels, reduction="sum" /
num_items_in_batch; forward+backward; time = median of 3 after a warm-up, peak = live
tensor bytes from ``LiveTensorTracker``):

    fp32  upstream unsplit ForCausalLMLoss   1144 ms   384.0 MiB (holds [N, V] logits etc.)
          ours (this Function)              3800-5600 ms   52.1 MiB
          linear_cross_entropy, policy auto  1728 ms    36.0 MiB
          linear_cross_entropy, "accurate"   4236 ms    36.0 MiB
          loss/grad relative error vs upstream: ours 2e-7 / 4e-7, linear_cross_entropy 0 / 4e-7
    bf16 (N=512)  upstream 155 ms 96 MiB; ours 568 ms 40 MiB, loss identical, grads within
          bf16 rounding (3e-3); linear_cross_entropy auto 3331 ms / accurate 2494 ms, 16.5 MiB,
          loss off by 1.6% / 0.9% (it does not round the logits to bf16 as upstream does).
          Rechecked (N=512, d=64, V=4000): the loss comes back in bf16, 0.28% off upstream's.

The fp32 / ``linear_cross_entropy`` peaks in both tables above miss that op's [chunk, V] logits: they
were measured before ``LiveTensorTracker`` ran the bodies of ``torch.library`` custom ops under itself
(5.24.0+mst.10). The LM-head anchors (docs/measurements.md) are measured inside it and supersede them.

Hence: a plain fp32 ``nn.Linear`` head without bias, hooks or soft-capping, outside
autocast, goes to ``linear_cross_entropy`` (faster, exact); everything else (bf16/fp16,
autocast, soft-capping, bias, LoRA / quantized / hooked heads) uses this Function, which
calls the module itself.

Except one case (since 5.24.0+mst.19): a plain half-precision ``nn.Linear`` head whose weight trains, with fewer
tokens than vocabulary rows (``_vocab_sliced_backward_pays``). There the fp32 [V, d] weight-gradient sum is the
largest thing the loss holds (for a 262K vocabulary at d = 4096: 4 GiB, against 2 GiB for DeepSpeed ALST's bf16
``W.grad``), and ``_VocabSlicedLMLossFunction`` does without it: its backward walks the vocabulary in slices, each
slice's products one GEMM over all tokens, and holds an fp32 [N, d] sum instead, for one more logits GEMM (4
[N, d] x [d, V]-sized GEMMs a step instead of 3, as ALST's tiled loss). docs/measurements.md has its peaks and times against the anchors.
"""

import torch
import torch.nn.functional as F

from . import fused_loss
from .compiled import traced_loss
from ..mst_core.grads import accumulate_grads, add_linear_weight_grad, add_product_fp32
from ..mst_core.wrappers import (
    is_plain_parameter,
    call_hooks_once,
    check_graph_inputs,
    checkpointed_chunks,
    function_parameters,
    raw_forward,
    refuse_create_graph,
    require_gradients,
)


def _apply_softcap(logits: torch.Tensor, cap):
    # Gemma-2 order and dtype (modeling_gemma2.py): in the logits' own dtype, before the
    # loss upcasts to float32.
    if cap is None:
        return logits
    logits = logits / cap
    logits = torch.tanh(logits)
    return logits * cap


def _check_vocab(logits, vocab_size):
    if logits.shape[-1] != vocab_size:
        raise ValueError(f"lm_head produced {logits.shape[-1]} logits per token, expected vocab_size={vocab_size}")
    return logits


def _chunk_loss_sum(lm_head, hidden_chunk, labels_chunk, softcap, ignore_index, vocab_size):
    logits = _check_vocab(_apply_softcap(lm_head(hidden_chunk), softcap), vocab_size)
    # fp32 as upstream ForCausalLMLoss; only one chunk's [C, V] logits exist. Labels follow the logits
    # (an lm_head on another device under device_map), as upstream.
    return _CrossEntropySum.apply(logits, labels_chunk.to(logits.device), ignore_index)


# Row blocks per chunk in `_cross_entropy_sum_and_grad`: its fp32 work is done an eighth of the chunk at a time,
# so a bf16 chunk never has an fp32 copy of its [C, V] logits nor an fp32 [C, V] gradient (a block's fp32
# buffer is a quarter of the chunk's bf16 logits' bytes; `log_softmax` of a bf16 block holds two such buffers at
# once, half the chunk's bytes: the sliced forward, whose peak is one chunk's logits, runs twice the blocks).
# Until mst.8 blocks were also capped at 8 MiB (16 rows at V=128K): 64 blocks per 1024-token chunk, a dozen small
# kernels each, and on an H100 the LM head + loss ran 100 ms on the host for 28 ms of GPU work (Llama-3.2-1B
# shapes, 4K tokens; `scripts/cuda_check.py --profile`).
_ROW_BLOCKS_PER_CHUNK = 8


def _cross_entropy_sum_and_grad(logits, labels, ignore_index, grad_scale, grad_out, lse_out=None, row_blocks=None):
    """fp32 sum of the token losses of ``logits`` [C, V] (upstream: ``F.cross_entropy(logits.float(),
    labels, reduction="sum")``), and ``grad_scale`` times its gradient written into ``grad_out``
    (shape and dtype of ``logits``; may be ``logits`` itself: each block of rows is read before it
    is written). The gradient is computed as upstream's backward does, in fp32 from the fp32
    log-probabilities: ``exp(log_probs) * scale``, minus ``scale`` at the target, zero on ignored
    tokens; then rounded once to the logits' dtype. A few rows at a time, so the fp32 buffers are
    small. With ``grad_out=None`` only the sum is computed. ``lse_out`` [C]: each row's fp32 log-sum-exp is written
    there (the log-probabilities are then the fp32 logits minus it). A half-precision block's ``log_softmax`` in fp32
    holds two fp32 blocks at once (torch converts the block first, then writes the result; fp16 on CUDA excepted)."""
    # Everything that is per token ([C] or [C, 1]) is computed once for the chunk, so a block of rows costs only its
    # [rows, V] passes: on a GPU each torch call is a kernel launch, which sets the time where blocks are small (17
    # calls per block until mst.27; on an H200 the LM head at 8K tokens x V=32000 took 53 ms, now 24: docs/cuda).
    labels = labels.to(logits.device)
    valid = labels != ignore_index
    safe_target = torch.where(valid, labels, 0).unsqueeze(1)  # [C, 1]
    if lse_out is not None:  # before the loop: ``grad_out`` may overwrite the logits
        target_logits = logits.gather(1, safe_target).squeeze(1).float()  # [C]
    scale = minus_scale = None
    if grad_out is not None:
        scale = torch.where(valid, grad_scale, 0.0).unsqueeze(1)  # [C, 1]
        minus_scale = -scale
    picked = None
    if fused_loss.applies(logits):  # one reduction and one pointwise kernel for the whole chunk (fused_loss.py)
        if grad_out is None:
            picked = fused_loss.log_prob_at_target(logits, safe_target)
        else:
            if grad_out is not logits:
                grad_out.copy_(logits)
            picked = fused_loss.loss_grad_(grad_out, safe_target, scale)
    if picked is None:
        picked = _log_probs_at_target_by_blocks(logits, safe_target, scale, minus_scale, grad_out, row_blocks)
    if lse_out is not None:
        # log p(t) = logit(t) - lse at any column t: one fused kernel gives both, where torch.logsumexp of an fp32
        # copy reads the block four more times (on a GPU this loss is bound by memory traffic)
        lse_out.copy_(target_logits - picked)
    return -torch.where(valid, picked, 0.0).sum()


def _log_probs_at_target_by_blocks(logits, safe_target, scale, minus_scale, grad_out, row_blocks):
    """`_cross_entropy_sum_and_grad`'s fp32 work in eager torch, a block of rows at a time: [C] log p(target), and
    the gradient written into ``grad_out`` unless it is None."""
    picked = []  # per block [rows, 1]: log p(target), fp32
    rows = max(1, -(-logits.shape[0] // (row_blocks or _ROW_BLOCKS_PER_CHUNK)))
    for start in range(0, logits.shape[0], rows):
        block = slice(start, start + rows)
        log_probs = F.log_softmax(logits[block], dim=-1, dtype=torch.float32)
        picked.append(log_probs.gather(1, safe_target[block]))
        if grad_out is not None:
            grad = log_probs.exp_().mul_(scale[block])
            grad.scatter_add_(1, safe_target[block], minus_scale[block])
            grad_out[block].copy_(grad)
            del grad
        del log_probs  # before the next block's is allocated
    return torch.cat(picked).squeeze(1)  # [C]


class _CrossEntropySum(torch.autograd.Function):
    """``F.cross_entropy(logits.float(), labels, reduction="sum")`` for one chunk's [C, V] logits, with the
    fp32 work done a few rows at a time (`_cross_entropy_sum_and_grad`). Saves the logits (the head's output,
    alive anyway while the chunk's graph is) and labels; backward computes the logits' gradient into one
    buffer of the logits' dtype. Upstream's expression would keep an fp32 copy of the logits and their fp32
    log-probabilities for backward, then build fp32 and half gradients: for a bf16 chunk 8x the logits'
    bytes more. Used where autograd must see each chunk (the wrapper path's checkpointed chunks) and in
    the no-grad loop."""

    @staticmethod
    def forward(ctx, logits, labels, ignore_index):
        ctx.save_for_backward(logits, labels)
        ctx.ignore_index = ignore_index
        return _cross_entropy_sum_and_grad(logits, labels, ignore_index, None, None)

    @staticmethod
    def backward(ctx, grad_sum):
        refuse_create_graph("mini-sequence LM-head loss")
        logits, labels = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        _cross_entropy_sum_and_grad(logits, labels, ctx.ignore_index, grad_sum.float(), grad_logits)
        return grad_logits, None, None


def _manual_weight(lm_head, wanted_params, device_type):
    """The weight of a plain ``nn.Linear`` head (no replaced forward, no autocast cast) whose
    gradient the Function computes itself with `add_linear_weight_grad`, else None (autograd
    then computes it, a whole [V, d] tensor per chunk). Hooks were ruled out by
    ``function_parameters``."""
    if type(lm_head) is not torch.nn.Linear or "forward" in lm_head.__dict__:
        return None
    if torch.is_autocast_enabled(device_type):
        return None
    weight = lm_head.weight
    return weight if any(p is weight for p in wanted_params) else None


def _keep(tensor):
    return tensor


class _MiniSequenceLMLossFunction(torch.autograd.Function):
    """Returns the fp32 sum of the token losses divided by ``divisor`` (the token count or
    ``num_items_in_batch``). The logits gradient is scaled by ``1 / divisor`` in fp32 before it is
    rounded to the logits' dtype, as upstream divides before its backward, so a bf16 hidden-state
    gradient is rounded once, like upstream's. (Scaling the stored bf16 gradient in backward
    rounded it twice, and by a bf16-rounded 1/N: 1.26-1.38x upstream's error against fp64,
    measured over 21 seeds.)"""

    @staticmethod
    def forward(ctx, hidden, labels, chunk_size, lm_head, softcap, ignore_index, vocab_size, divisor, *params):
        needs_param = ctx.needs_input_grad[8:]
        wanted_params = [p for p, need in zip(params, needs_param) if need]
        loss, ctx.grad_hidden, ctx.param_grads = loss_and_grads(
            hidden, labels, chunk_size, lm_head, softcap, ignore_index, vocab_size, divisor, params, wanted_params,
            ctx.needs_input_grad[0],
        )
        ctx.param_dtypes = [p.dtype for p in wanted_params]
        ctx.needs_param = needs_param
        return loss  # the value only: backward uses the gradients scaled in the forward

    @staticmethod
    def backward(ctx, grad_total):
        refuse_create_graph("mini-sequence LM-head loss")
        if ctx.param_grads is None:
            raise RuntimeError(
                "mini-sequence LM loss: backward called twice; its precomputed gradients are "
                "consumed by the first backward (retain_graph is not supported)."
            )
        grad_hidden, scaled = scale_precomputed_grads(grad_total, ctx.grad_hidden, ctx.param_grads, ctx.param_dtypes)
        scaled = iter(scaled)
        param_grads = [next(scaled) if need else None for need in ctx.needs_param]
        ctx.grad_hidden = None
        ctx.param_grads = None
        return (grad_hidden, None, None, None, None, None, None, None, *param_grads)


def loss_and_grads(
    hidden, labels, chunk_size, lm_head, softcap, ignore_index, vocab_size, divisor, params, wanted_params, needs_hidden
):
    """`_MiniSequenceLMLossFunction`'s forward: (the loss, the hidden states' gradient or None, the sums of the
    gradients of `wanted_params`, fp32 for half precision), the gradients those of the loss sum scaled by
    `1 / divisor`. `params` are all the head's parameters the caller's graph takes (`check_graph_inputs`)."""
    grad_hidden = torch.empty_like(hidden) if needs_hidden else None
    # fp32 accumulation of half-precision parameter grads: rounded once, like the unsplit
    # matmul (see mlp.py for the measurement).
    acc = [None] * len(wanted_params)
    weight = _manual_weight(lm_head, wanted_params, hidden.device.type)
    if weight is not None:
        half = weight.dtype in (torch.float16, torch.bfloat16)
        weight_index = next(i for i, p in enumerate(wanted_params) if p is weight)
        acc[weight_index] = torch.zeros_like(weight, dtype=torch.float32 if half else weight.dtype)
    autograd_params = [p for p in wanted_params if p is not weight]
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    divisor = divisor.to(hidden.device)
    # d(loss) / d(sum of the token losses), in fp32 as upstream's division backward computes it; 0 for a
    # divisor of 0 (see `divide_loss_sum`).
    grad_scale = torch.where(divisor == 0, 0.0, torch.ones((), dtype=torch.float32, device=hidden.device) / divisor)

    num_tokens = hidden.shape[0]
    for start in range(0, num_tokens, chunk_size):
        end = min(start + chunk_size, num_tokens)
        saved = []  # storages the chunk's graph saves (held by the graph anyway)

        def record_saved(tensor):
            saved.append(tensor.untyped_storage())
            return tensor

        # Saved-tensor hooks that keep tensors as they are: this inner graph lives and dies
        # here, so the hooks of an enclosing non-reentrant checkpoint must not pack it (each
        # unpack by autograd.grad would re-run the whole checkpointed region: quadratic in the
        # chunk count). They also tell whether the graph saved the logits themselves.
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(record_saved, _keep):
            h_chunk = hidden[start:end].detach().requires_grad_(needs_hidden)
            raw = lm_head(h_chunk)
            logits = _check_vocab(_apply_softcap(raw, softcap), vocab_size)
        if start == 0:
            check_graph_inputs(logits, [h_chunk, *params], "mini-sequence LM-head loss")
        # The logits' gradient overwrites the logits (one [C, V] buffer instead of two) unless
        # the head's backward needs them (then autograd would refuse the modified tensor).
        in_place = not any(storage is logits.untyped_storage() for storage in saved)
        grad_logits = logits if in_place else torch.empty_like(logits)
        with torch.no_grad():
            chunk_sum = _cross_entropy_sum_and_grad(
                logits, labels[start:end], ignore_index, grad_scale.to(logits.device), grad_logits
            )
        total += chunk_sum.to(total.device)

        inputs = ([h_chunk] if needs_hidden else []) + autograd_params
        # Soft-capped: the weight gradient needs the gradient of the head's own output.
        want_raw = weight is not None and raw is not logits
        if want_raw:
            inputs.append(raw)
        grads = torch.autograd.grad(logits, inputs, grad_logits, allow_unused=True) if inputs else ()
        require_gradients(grads, inputs, "mini-sequence LM-head loss")
        if weight is not None:
            grad_raw = grads[-1] if want_raw else grad_logits
            add_linear_weight_grad(acc[weight_index], grad_raw, h_chunk.detach())
            grads = grads[:-1] if want_raw else grads
            del grad_raw
        del raw, logits, grad_logits  # frees the chunk's [C, V] buffers before the next chunk
        if needs_hidden:
            grad_hidden[start:end].copy_(grads[0])
            grads = grads[1:]
        # Back to one entry per wanted parameter (None for the weight done above).
        grads = iter(grads)
        accumulate_grads(acc, [None if p is weight else next(grads) for p in wanted_params])

    return total / divisor, grad_hidden, acc


def scale_precomputed_grads(grad_total, grad_hidden, param_grads, param_dtypes, in_place=True):
    """`loss_and_grads`' gradients times the loss's incoming gradient: (the hidden states', [each parameter's, in its
    dtype]). In place: the stored [N, d] buffer becomes the returned gradient, and for a bf16 Llama-3-8B head
    `(g * grad_total)` would add a second fp32 [V, d] buffer (2 GiB) next to the sum at the start of backward. A
    compiled graph's backward (compiled.py) multiplies out of place, which inductor fuses with the rounding."""
    mul = torch.Tensor.mul_ if in_place else torch.Tensor.mul
    if grad_hidden is not None:
        grad_hidden = mul(grad_hidden, grad_total.to(grad_hidden.dtype))
    return grad_hidden, [mul(g, grad_total.to(g.dtype)).to(dtype) for g, dtype in zip(param_grads, param_dtypes)]


# Rows of a vocabulary slice of `_VocabSlicedLMLossFunction`'s backward are a multiple of this (GEMM tiles; V=151936
# in 8192-row slices of 7997 rows ran 4.5x slower than ALST on an H100: docs/cuda/README.md).
_VOCAB_SLICE_ALIGN = 128


def _vocab_slice_rows(vocab_size: int, tokens: int, chunk_size: int, hidden_size: int) -> int:
    """Vocabulary rows per slice of `_VocabSlicedLMLossFunction`'s backward (rounded up to `_VOCAB_SLICE_ALIGN`): a
    slice's [tokens, rows] logits hold as many elements as one forward chunk's [chunk_size, V] logits, and at most
    half as many as the [V, d] weight, so that beside the weight gradient the backward returns they stay below the
    forward's chunk (at d = 256, 8K tokens, V = 128256, slices of a chunk's size made the loss's peak 388 MiB against
    its forward's 313)."""
    per_token = min(chunk_size, tokens, max(1, hidden_size // 2))  # the slice's elements / vocab_size
    rows = -(-vocab_size * per_token // max(tokens, 1))
    return min(vocab_size, -(-rows // _VOCAB_SLICE_ALIGN) * _VOCAB_SLICE_ALIGN)


def _vocab_sliced_backward_pays(lm_head, hidden, params, vocab_size) -> bool:
    """Whether `_VocabSlicedLMLossFunction` applies to ``lm_head`` and holds less than `_MiniSequenceLMLossFunction`:
    a plain half-precision ``nn.Linear`` head whose weight is the only parameter that wants a gradient (a trainable
    bias or LoRA head: no), ``hidden`` [N, d] in its dtype, and fewer tokens than vocabulary rows: its fp32 sum, the
    hidden states' gradient [N, d], is then smaller than the other Function's [V, d] one."""
    weight = _manual_weight(lm_head, params, hidden.device.type)
    if weight is None or len(params) != 1 or weight.dtype not in (torch.float16, torch.bfloat16):
        return False
    if hidden.dtype != weight.dtype or weight.shape[0] != vocab_size or weight.device != hidden.device:
        return False
    return hidden.shape[0] < vocab_size


class _VocabSlicedLMLossFunction(torch.autograd.Function):
    """The loss of `_MiniSequenceLMLossFunction` for a half-precision plain ``nn.Linear`` head, without its fp32 [V, d]
    weight-gradient sum (`_vocab_sliced_backward_pays` says when).

    Forward (no graph): ``lm_head(chunk)`` chunk by chunk, the fp32 loss sum and each token's fp32 log-sum-exp
    (saved: [N] floats). Backward: the vocabulary in slices (`_vocab_slice_rows`: a slice's [N, rows] logits are at
    most as large as a forward chunk's [C, V]); for each slice, every token's logits of that slice again (one GEMM), their
    gradient from the saved log-sum-exp (as upstream's cross-entropy backward computes it, in fp32 a block of rows at
    a time, then rounded once to the logits' dtype; through the soft-cap by autograd), then the slice's weight
    gradient as one GEMM over all tokens (rounded once, as upstream's single GEMM rounds it) and the hidden states'
    gradient summed over the slices in fp32 (`add_product_fp32`: no product rounded to half precision, as the unsplit
    GEMM sums over the whole vocabulary; rounded once at the end). So the only fp32 sum is [N, d], not [V, d]: for a
    262K vocabulary at d = 4096 in bf16, 0.5 GiB at 32K tokens instead of 4 GiB. The price: the logits are computed
    twice (forward and backward), one more [N, d] x [d, V] GEMM than the other Function, as DeepSpeed ALST's tiled
    loss does (arXiv 2506.13996). The head's weight and bias are read by slice as ``nn.Linear.forward`` reads them
    (``F.linear``): only a module of exactly that class comes here."""

    @staticmethod
    def forward(ctx, hidden, labels, chunk_size, lm_head, softcap, ignore_index, divisor, weight):
        loss, lse = sliced_loss(hidden, labels, chunk_size, lm_head, softcap, ignore_index, divisor)
        ctx.save_for_backward(hidden, labels, lse, divisor.to(hidden.device))
        ctx.chunk_size, ctx.lm_head, ctx.softcap, ctx.ignore_index = chunk_size, lm_head, softcap, ignore_index
        return loss

    @staticmethod
    def backward(ctx, grad_total):
        refuse_create_graph("mini-sequence LM-head loss")
        hidden, labels, lse, divisor = ctx.saved_tensors
        grad_hidden, grad_weight = sliced_grads(
            grad_total, hidden, labels, lse, divisor, ctx.lm_head, ctx.softcap, ctx.ignore_index, ctx.chunk_size,
            ctx.needs_input_grad[0],
        )
        return grad_hidden, None, None, None, None, None, None, grad_weight


def sliced_loss(hidden, labels, chunk_size, lm_head, softcap, ignore_index, divisor):
    """`_VocabSlicedLMLossFunction`'s forward: (the loss, each token's fp32 log-sum-exp [N])."""
    lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk_size):
        end = min(start + chunk_size, hidden.shape[0])
        logits = _apply_softcap(lm_head(hidden[start:end]), softcap)
        # twice the blocks: log_softmax of a half-precision block holds two fp32 blocks at once, together a
        # quarter of the chunk's bf16 logits' bytes
        total += _cross_entropy_sum_and_grad(logits, labels[start:end], ignore_index, None, None, lse[start:end],
                                             row_blocks=2 * _ROW_BLOCKS_PER_CHUNK)
        del logits
    return total / divisor.to(hidden.device), lse


def sliced_grads(grad_total, hidden, labels, lse, divisor, lm_head, softcap, ignore_index, chunk_size, needs_hidden):
    """`_VocabSlicedLMLossFunction`'s backward: (the hidden states' gradient or None, the weight's)."""
    hidden = hidden.detach()
    weight, bias = lm_head.weight.detach(), lm_head.bias
    # d(loss) / d(each token's loss) in fp32, as upstream's division backward computes it; 0 for an ignored token
    # and for a divisor of 0 (see `divide_loss_sum`).
    scale = torch.where(divisor == 0, 0.0, grad_total.float() / divisor)
    valid = labels != ignore_index
    magnitude = torch.where(valid, scale.abs(), 0.0).unsqueeze(1)
    # exp(logit - shift) is the softmax times |scale| (+inf where it is 0: a zero row), its sign applied when the
    # gradient is rounded to half precision: two fewer fp32 passes over each slice than exp, then scale
    shift = lse.unsqueeze(1) - magnitude.log()
    sign = torch.sign(scale)
    target = torch.where(valid, labels, -1)
    grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if needs_hidden else None
    grad_weight = torch.empty_like(weight)
    tokens = hidden.shape[0]
    slice_rows = _vocab_slice_rows(weight.shape[0], tokens, chunk_size, weight.shape[1])
    block = max(1, -(-tokens // _ROW_BLOCKS_PER_CHUNK))  # fp32 rows at a time: a quarter of the slice's bytes
    for first in range(0, weight.shape[0], slice_rows):
        last = min(first + slice_rows, weight.shape[0])
        weight_slice = weight[first:last]
        bias_slice = None if bias is None else bias.detach()[first:last]
        logits = raw = F.linear(hidden, weight_slice, bias_slice)  # [N, rows]
        if softcap is not None:
            with torch.enable_grad():
                logits = _apply_softcap(raw.requires_grad_(), softcap)
        # Without a soft-cap the gradient overwrites the logits (each block is read before it is written).
        grad = raw if softcap is None else torch.empty_like(raw)
        # the targets in this slice, once per slice ([N, 1]): a block then costs its three [rows, slice] passes
        in_slice = ((target >= first) & (target < last)).unsqueeze(1)
        column = torch.where(in_slice, target.unsqueeze(1) - first, 0)
        at_target = torch.where(in_slice, -magnitude, 0.0)
        fused = fused_loss.applies(grad)
        if fused and softcap is not None:
            grad.copy_(logits.detach())
        if not (fused and fused_loss.sliced_grad_(grad, shift, column, at_target, sign)):
            for start in range(0, tokens, block):
                rows = slice(start, start + block)
                part = torch.sub(logits[rows].detach(), shift[rows]).exp_()  # fp32: half - fp32 promotes
                part.scatter_add_(1, column[rows], at_target[rows])
                torch.mul(part, sign, out=grad[rows])
                del part
        if softcap is not None:
            (grad,) = torch.autograd.grad(logits, raw, grad)
        del raw, logits
        torch.mm(grad.T, hidden, out=grad_weight[first:last])
        if needs_hidden:
            add_product_fp32(grad_hidden, grad, weight_slice)
        del grad
    if needs_hidden:
        grad_hidden = grad_hidden.to(hidden.dtype)
    return grad_hidden, grad_weight


def _can_use_linear_cross_entropy(lm_head, hidden, softcap, vocab_size) -> bool:
    """True when torch's fused chunked op computes exactly what ``lm_head`` + loss would."""
    if not hasattr(F, "linear_cross_entropy") or not hasattr(torch.nn, "LinearCrossEntropyOptions"):
        return False
    if softcap is not None or type(lm_head) is not torch.nn.Linear or lm_head.bias is not None:
        return False
    # Any hook or replaced forward (accelerate offload, ZeRO-3 gathering, ...) must run: call the module.
    if lm_head._forward_hooks or lm_head._forward_pre_hooks or "forward" in lm_head.__dict__:
        return False
    from torch.nn.modules import module as _module

    if _module._global_forward_hooks or _module._global_forward_pre_hooks:
        return False
    weight = lm_head.weight
    if weight.dtype != torch.float32 or hidden.dtype != torch.float32 or weight.shape[0] != vocab_size:
        return False
    if torch.is_autocast_enabled(hidden.device.type):
        return False
    # A registered leaf nn.Parameter (or its FakeTensor twin under FakeTensorMode): no subclass (DTensor, quantized
    # weight) and no view installed by a wrapper (FSDP1), which the fused op could not be handed while compiling.
    return is_plain_parameter(weight) and weight.device == hidden.device


def divide_loss_sum(loss_sum: torch.Tensor, divisor: torch.Tensor) -> torch.Tensor:
    """``loss_sum / divisor`` (upstream's ``reduction="sum"`` then ``/ num_items_in_batch``, or its mean), with
    upstream's gradients when ``divisor`` is 0.

    A divisor of 0 means there is nothing to predict: every label is ignored and ``num_items_in_batch`` is 0 (the
    Trainer passes 0 when no micro-batch of an accumulation window has a label), or no ``num_items_in_batch`` and
    no label. Upstream's loss is then NaN (0 / 0) and its gradients are exactly 0, because cross-entropy's own
    backward writes 0 for ignored tokens whatever the incoming gradient. A chunked loss cannot rely on that: its
    ``d loss / d loss_sum = 1 / 0 = inf`` reaches code (``F.linear_cross_entropy``'s backward, a hand-written
    gradient) that multiplies it by the zeros of ignored tokens and returns NaN for every weight. So: the same
    value (``loss_sum / divisor``: NaN for 0 / 0), and a gradient of 0 into ``loss_sum`` when the divisor is 0.
    Where/where instead of a branch: no host sync."""
    divisor = divisor.to(loss_sum.device)
    empty = divisor == 0
    safe_divisor = torch.where(empty, 1, divisor)
    return torch.where(empty, loss_sum.detach() / divisor, loss_sum / safe_divisor)


def _shift_and_flatten_labels(labels, shift_labels, ignore_index, device):
    # As upstream ForCausalLMLoss: pad with ignore_index, shift left by one.
    if shift_labels is None:
        labels = F.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:].contiguous()
    return shift_labels.reshape(-1).to(device)


def mini_sequence_causal_lm_loss(
    hidden_states: torch.Tensor,
    lm_head: torch.nn.Module,
    labels: torch.Tensor | None,
    *,
    chunk_size: int,
    vocab_size: int,
    num_items_in_batch=None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    final_logit_softcapping: float | None = None,
) -> torch.Tensor:
    """Causal-LM loss of ``lm_head(hidden_states)`` computed ``chunk_size`` tokens at a time.

    Equals upstream ``ForCausalLMLoss(softcap(lm_head(hidden_states)), labels, vocab_size,
    num_items_in_batch, ignore_index, shift_labels)``: fp32 cross-entropy, labels shifted by
    one unless ``shift_labels`` is given, sum divided by ``num_items_in_batch`` when given,
    else the mean over non-ignored tokens (NaN when every label is ignored, like upstream).
    """
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])  # [*, S, d] -> [N, d]
    flat_labels = _shift_and_flatten_labels(labels, shift_labels, ignore_index, hidden.device)
    if flat_labels.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"labels give {flat_labels.shape[0]} tokens but hidden_states has {hidden.shape[0]}"
        )

    # Upstream: the loss sum divided by num_items_in_batch when given (fixed_cross_entropy, tensor
    # moved to the device), else the mean over non-ignored tokens. Either may be 0: `divide_loss_sum`.
    if num_items_in_batch is not None:
        divisor = torch.as_tensor(num_items_in_batch, device=hidden.device)
    else:
        divisor = (flat_labels != ignore_index).sum()

    params = function_parameters(lm_head) if torch.is_grad_enabled() else None
    use_linear_cross_entropy = _can_use_linear_cross_entropy(lm_head, hidden, final_logit_softcapping, vocab_size)
    # While torch.compile traces, `function_parameters` is None for every head, but a plain fp32 head (no hooks: the
    # check above) can still take torch's fused op, which compiles; the checkpointed chunks recompute the logits.
    if torch.is_grad_enabled() and params is None and not (use_linear_cross_entropy and torch.compiler.is_compiling()):
        traced = traced_loss(
            lm_head, hidden, flat_labels, divisor, chunk_size, final_logit_softcapping, ignore_index, vocab_size
        )
        if traced is not None:
            return traced  # under torch.compile: one operator of the graph (compiled.py)
        # A wrapper (ZeRO-3, FSDP, accelerate hooks) may swap the head's weight at call time: let
        # autograd see each chunk's real forward, recomputing the chunk's logits in backward.
        head = raw_forward(lm_head)

        def chunked_loss_sum(hidden):
            chunk_sums = checkpointed_chunks(
                lambda h, start, end: _chunk_loss_sum(
                    head, h, flat_labels[start:end], final_logit_softcapping, ignore_index, vocab_size
                ),
                hidden,
                chunk_size,
                dim=0,
            )
            return torch.stack([s.to(chunk_sums[0].device) for s in chunk_sums]).sum()

        loss = divide_loss_sum(call_hooks_once(lm_head, chunked_loss_sum, hidden), divisor)
    elif use_linear_cross_entropy:
        # Under torch.compile, torch forces allow_retain_graph=True itself, with a warning that breaks the graph.
        options = torch.nn.LinearCrossEntropyOptions(
            batch_chunk_size=chunk_size, chunking_method=None, allow_retain_graph=torch.compiler.is_compiling()
        )
        loss_sum = F.linear_cross_entropy(
            hidden, lm_head.weight, flat_labels, reduction="sum", ignore_index=ignore_index, options=options
        )
        loss = divide_loss_sum(loss_sum, divisor)
    elif params is not None and _vocab_sliced_backward_pays(lm_head, hidden, params, vocab_size):
        loss = _VocabSlicedLMLossFunction.apply(
            hidden, flat_labels, chunk_size, lm_head, final_logit_softcapping, ignore_index, divisor, lm_head.weight
        )
    elif params is not None and (hidden.requires_grad or params):
        loss = _MiniSequenceLMLossFunction.apply(
            hidden, flat_labels, chunk_size, lm_head, final_logit_softcapping, ignore_index, vocab_size, divisor,
            *params,
        )
    else:
        # No gradient wanted: a plain loop, nothing is kept.
        with torch.no_grad():
            loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
            for start in range(0, hidden.shape[0], chunk_size):
                end = start + chunk_size
                loss_sum += _chunk_loss_sum(
                    lm_head, hidden[start:end], flat_labels[start:end], final_logit_softcapping, ignore_index, vocab_size
                ).to(loss_sum.device)
        loss = divide_loss_sum(loss_sum, divisor)
    return loss

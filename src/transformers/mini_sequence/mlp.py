"""Mini-sequence MLP (MsT Algorithms 1 and 3).

The gated MLP ``down(act(gate(x)) * up(x))`` is token-wise, so splitting the sequence into
chunks changes nothing mathematically. The memory saving only exists if the [S, I]
intermediates are neither materialised whole nor kept for backward (docs/mini-sequence.md, "What changes"): a plain
Python loop under autograd would keep every chunk's intermediates until backward. So the
chunked path is a custom autograd Function that keeps only the input x for backward and, in
backward, rebuilds one chunk's intermediates at a time (recomputation, as in Algorithm 3).
"""

import contextlib

import torch

from ..mst_core.grads import linear_weight_grads_summed, summed_as_computed
from .compiled import traced_chunks
from ..mst_core.model_checks import foreign_forward
from ..mst_core.replay import capture_autocast_state, capture_rng_state, restore_autocast_state, restore_rng_state
from ..mst_core.router_logits import positions
from ..mst_core.wrappers import (
    check_graph_inputs,
    checkpointed_chunks,
    function_parameters,
    refuse_create_graph,
    require_gradients,
    SavedInput,
)


def module_forward(module, x):
    """``module``'s own class ``forward`` on ``x`` (one mini-sequence): upstream's body, not a re-spelling of it.

    The patched forwards start with ``if (mini_sequence_out := mini_sequence.mlp_forward(self, x)) is not None:
    return mini_sequence_out`` (``moe_forward`` for the MoE blocks), which return None for an input of at most one
    mini-sequence, so each chunk passed back in here runs the upstream lines below them (no flag or context
    variable: the guard is the chunk's length). The class's function, not ``module.forward``: an instance-level
    replacement (accelerate's hooks) already ran once around the whole call; the submodules' hooks (PEFT LoRA,
    quantized linears) still run per chunk."""
    return type(module).forward(module, x)


def _chunk_bounds(seq_len: int, chunk_size: int):
    return [(start, min(start + chunk_size, seq_len)) for start in range(0, seq_len, chunk_size)]


def _as_outputs(result) -> tuple:
    return result if isinstance(result, tuple) else (result,)


def _forward_chunks(forward_fn, mlp, x, chunk_size):
    """Run ``forward_fn`` chunk by chunk, writing into preallocated outputs (a ``cat`` would briefly hold the chunks
    and the result together). ``forward_fn`` returns one tensor [..., C, *] or a tuple whose first tensor is that and
    whose others are token-major [batch * C, *] (mst_core/router_logits.py); so does this, for the whole sequence."""
    seq_len, batch_shape = x.shape[-2], x.shape[:-2]
    outs = None
    for start, end in _chunk_bounds(seq_len, chunk_size):
        chunk_outs = _as_outputs(forward_fn(mlp, x[..., start:end, :]))
        if outs is None:
            # Allocated after the first chunk: under autocast the output dtype differs from x.
            outs = [chunk_outs[0].new_empty(batch_shape + (seq_len,) + chunk_outs[0].shape[-1:])]
            outs += [o.new_empty((batch_shape.numel() * seq_len,) + o.shape[1:]) for o in chunk_outs[1:]]
        for i, (whole, part) in enumerate(zip(outs, chunk_outs)):
            if i == 0:
                whole[..., start:end, :].copy_(part)
            else:
                positions(whole, batch_shape).narrow(len(batch_shape), start, end - start).copy_(
                    positions(part, batch_shape))
        del chunk_outs  # only one chunk's intermediates alive at a time
    return outs[0] if len(outs) == 1 else tuple(outs)


def _chunk_grad(grad: torch.Tensor, index: int, batch_shape: torch.Size, start: int, end: int) -> torch.Tensor:
    """The part of output ``index``'s gradient that belongs to positions start:end, shaped as the chunk's output."""
    if index == 0:
        return grad[..., start:end, :]
    part = positions(grad.contiguous(), batch_shape).narrow(len(batch_shape), start, end - start)  # [*batch, c, *]
    return part.reshape(-1, *grad.shape[1:])  # [*batch, c, *] -> [batch * c, *], token-major as the chunk's output


class _MiniSequenceMLPFunction(torch.autograd.Function):
    """Inputs: x [..., S, d] (the output of `SavedInput`, which holds it for backward, if it requires grad), the chunk
    size, ``forward_fn(mlp, chunk)`` (one tensor, or a tuple: `_forward_chunks`), whether to sum half-precision
    parameter gradients in fp32 (`accumulate_grads`), the MLP's parameters that require grad (as ``*params`` so that autograd routes their gradients through this
    Function: hooks of DDP/FSDP/DeepSpeed then fire once per parameter, and non-leaf parameters work)."""

    @staticmethod
    def forward(ctx, x, chunk_size, forward_fn, mlp, fp32_sums, *params):
        ctx.set_materialize_grads(False)  # an output nothing used (GPT-OSS's router scores) gets None, not zeros
        if isinstance(x.grad_fn, SavedInput._backward_cls):
            ctx.input_node = x.grad_fn  # `SavedInput`'s node: it holds x
        else:  # a frozen input (only parameters train), or a caller without `SavedInput`: hold x here
            ctx.input_node = ctx
            ctx.save_for_backward(x)
        ctx.autocast_state = capture_autocast_state(x.device.type)
        # Dropout (e.g. LoRA dropout) must draw the same masks when a chunk is recomputed.
        ctx.rng_state = capture_rng_state(x.device)
        out = _forward_chunks(forward_fn, mlp, x, chunk_size)
        ctx.chunk_size = chunk_size
        ctx.fp32_sums = fp32_sums
        ctx.forward_fn = forward_fn
        ctx.mlp = mlp
        # Only x is kept, by `SavedInput` (through saved-tensor hooks, e.g. activation checkpointing).
        # The parameters are held by reference: the recomputation calls the submodules, which
        # use these very tensors, and autograd.grad is taken with respect to them.
        ctx.params = params
        return out

    @staticmethod
    def backward(ctx, *grad_outs):
        (x,) = ctx.input_node.saved_tensors
        if not any(grad is not None for grad in grad_outs):  # nothing downstream used any output
            return (None,) * (5 + len(ctx.params))
        grad_x, param_grads = backward_chunks(
            x, ctx.params, ctx.forward_fn, ctx.mlp, ctx.chunk_size, ctx.fp32_sums, grad_outs, ctx.needs_input_grad[0],
            ctx.needs_input_grad[5:], ctx.rng_state, ctx.autocast_state,
        )
        return (grad_x, None, None, None, None, *param_grads)


def backward_chunks(x, params, forward_fn, mlp, chunk_size, fp32_sums, grad_outs, needs_x, needs_param, rng_state,
                    autocast_state):
    """The gradients of `_forward_chunks(forward_fn, mlp, x, chunk_size)` given its outputs' `grad_outs` (None for an
    output nothing used): (x's gradient or None, [each parameter's gradient, None where `needs_param` says none]),
    each chunk rebuilt from `x` under the forward's RNG and autocast states, backpropagated and freed before the
    next. `_MiniSequenceMLPFunction`'s backward, and the compiled operator's (compiled.py)."""
    modules = mlp if isinstance(mlp, tuple) else (mlp,)
    where = f"mini-sequence {' + '.join(type(m).__name__ for m in modules)}"
    refuse_create_graph(where)
    wanted_params = [p for p, need in zip(params, needs_param) if need]
    used = [i for i, grad in enumerate(grad_outs) if grad is not None]
    grad_x = torch.empty_like(x) if needs_x else None
    # Parameter gradients are accumulated over chunks. For fp16/bf16 parameters the sum is
    # kept in fp32 and rounded once at the end: the unsplit matmul also accumulates in fp32
    # and rounds once, while a half-precision running sum rounds M times. Measured on a bf16
    # LlamaMLP (d=64, I=256, S=512, chunk 16 -> M=32), relative-norm error of the weight
    # grads vs an fp64 reference: unsplit bf16 5.2-5.4e-3, chunked with fp32 accumulator
    # 5.5-5.6e-3, chunked with bf16 accumulator 8.7-8.8e-3. The fp32 buffer costs
    # 2x the (half) parameter size, only while this layer's backward runs.
    acc = [None] * len(wanted_params)
    batch_shape = x.shape[:-2]

    with torch.enable_grad(), restore_rng_state(rng_state, x.device), restore_autocast_state(
        autocast_state
    ), summed_as_computed(acc, wanted_params, fp32_sums):
        for start, end in _chunk_bounds(x.shape[-2], chunk_size):
            x_chunk = x[..., start:end, :].detach().requires_grad_(needs_x)
            # Half-precision linear weights: their gradient goes into `acc` by one fp32-output GEMM per chunk
            # where the backend has one (CUDA), not as a half product added into the fp32 sum. Without such a
            # GEMM (the CPU) autograd's product and `summed_as_computed`'s add are as good, and cheaper.
            linear_sums = linear_weight_grads_summed(acc, wanted_params, x) if fp32_sums else None
            with linear_sums or contextlib.nullcontext():
                chunk_outs = _as_outputs(forward_fn(mlp, x_chunk))
            inputs = ([x_chunk] if needs_x else []) + wanted_params
            if start == 0:
                for i in used:
                    check_graph_inputs(chunk_outs[i], [x_chunk, *params], where)
            grads = torch.autograd.grad(
                [chunk_outs[i] for i in used],
                inputs,
                [_chunk_grad(grad_outs[i], i, batch_shape, start, end) for i in used],
                allow_unused=True,
            )
            # The parameters' gradients are zeros (their sums are in `acc`), or None for a weight whose every
            # use was a linear layer taken over above: `_LinearIntoWeightSums` summed it.
            taken = {id(wanted_params[i]) for i in getattr(linear_sums, "seen", ())}
            kept = [(g, t) for g, t in zip(grads, inputs) if id(t) not in taken]
            require_gradients([g for g, _ in kept], [t for _, t in kept], where)
            del chunk_outs  # frees this chunk's graph before the next one is built
            if needs_x:
                grad_x[..., start:end, :].copy_(grads[0])

    summed = iter(None if a is None else a.to(p.dtype) for a, p in zip(acc, wanted_params))
    return grad_x, [next(summed) if need else None for need in needs_param]


def mini_sequence_mlp(mlp, hidden_states: torch.Tensor, chunk_size: int, forward_fn=module_forward):
    """Apply ``mlp`` to ``hidden_states`` [..., S, d] in mini-sequences of ``chunk_size`` tokens.

    Same result as ``forward_fn(mlp, hidden_states)`` (default: the module's own upstream forward,
    `module_forward`), to fp32 rounding of the weight gradients. A sequence no longer than
    ``chunk_size`` takes the unsplit code path unchanged.
    """
    seq_len = hidden_states.shape[-2]
    if seq_len <= chunk_size:
        return forward_fn(mlp, hidden_states)

    if not torch.is_grad_enabled():
        # Inference: nothing is kept for backward, so a plain loop is enough.
        return _forward_chunks(forward_fn, mlp, hidden_states, chunk_size)
    kind = {module_forward: "mlp", _call_module: "norm"}.get(forward_fn)
    if kind is not None and (traced := traced_chunks(kind, (mlp,), hidden_states, chunk_size)) is not None:
        return traced  # under torch.compile: one operator of the graph (compiled.py)
    params = function_parameters(mlp)
    if params is None:
        # A wrapper (ZeRO-3, FSDP, accelerate hooks) may swap the weights at call time: let
        # autograd see each chunk's real forward (mst_core/wrappers.py explains why).
        chunks = checkpointed_chunks(lambda chunk, start, end: forward_fn(mlp, chunk), hidden_states, chunk_size)
        return torch.cat(chunks, dim=-2)
    return chunked_function(forward_fn, mlp, hidden_states, chunk_size, params, token_rows=True)


def chunked_function(forward_fn, module, hidden_states, chunk_size, params, fp32_sums=True, token_rows=False):
    """`forward_fn(module, hidden_states)` through `_MiniSequenceMLPFunction`, which takes `params` as inputs and sums
    their half-precision gradients over the chunks in fp32 unless `fp32_sums=False` (`accumulate_grads`).

    `token_rows`, for a token-wise block that returns one tensor (a dense MLP, a norm; not a MoE block, whose forward
    reads the batch and sequence sizes): a batch of one sequence [1, S, d] goes in as its tokens' rows [S, d], a view,
    and comes out as [1, S, *]. No hook sees it (the Function takes only modules without any: `function_parameters`).
    The numbers are the same (a linear layer on [1, C, d] is one [C, d] matrix product between two reshapes); each
    chunk's projections skip those reshapes and their backward's: on scripts/host_cost.py's stack (16 layers, 8
    chunks, batch 1) `mini_sequence+checkpointing` dispatched 13347 -> 11127 operators a step. A larger batch stays
    [B, S, d]: its chunk [B, C, d] is not one block of rows."""
    if token_rows and hidden_states.dim() == 3 and hidden_states.shape[0] == 1:
        out = chunked_function(forward_fn, module, hidden_states.view(hidden_states.shape[1:]), chunk_size, params,
                               fp32_sums)
        return out.view((1,) + out.shape)
    if not (hidden_states.requires_grad or params):
        return _forward_chunks(forward_fn, module, hidden_states, chunk_size)  # frozen: nothing to keep
    x = SavedInput.apply(hidden_states) if hidden_states.requires_grad else hidden_states
    return _MiniSequenceMLPFunction.apply(x, chunk_size, forward_fn, module, fp32_sums, *params)


def _mlp_then_norm(mlp_and_norm, x):
    mlp, norm = mlp_and_norm
    return norm(module_forward(mlp, x))


def mini_sequence_mlp_then_norm(mlp, norm, hidden_states: torch.Tensor, chunk_size: int):
    """`norm(mlp(hidden_states))` [..., S, d], both one mini-sequence at a time through one Function, for the decoder
    layers that normalize the MLP's output (Gemma-2, Gemma-3, OLMo-2: `post_feedforward_layernorm`).

    Why together: the norm saves its input, the MLP's whole output. Under activation checkpointing the layer's
    recompute then has to run the chunked MLP forward again to rebuild it, and the Function's backward rebuilds
    every chunk once more: 3 passes a step instead of checkpointing's 2 (`SavedInput`). Chunked together only the
    MLP's input is saved, and the norm's fp32 intermediates exist one chunk at a time. Where the Function may not
    take the parameters (a wrapper's or hook's module, torch.compile, a forward that is not transformers'), upstream's
    two calls run, the MLP still by mini-sequences through its own forward. Under torch.compile both are one operator
    of the graph (compiled.py) where they can be."""
    if hidden_states.shape[-2] > chunk_size and torch.is_grad_enabled():
        if (traced := traced_chunks("mlp_then_norm", (mlp, norm), hidden_states, chunk_size)) is not None:
            return traced
        mlp_params, norm_params = function_parameters(mlp), function_parameters(norm)
        if mlp_params is not None and norm_params is not None and foreign_forward(mlp) is None:
            return chunked_function(_mlp_then_norm, (mlp, norm), hidden_states, chunk_size, mlp_params + norm_params,
                                    token_rows=True)
    return norm(mlp(hidden_states))


def _call_module(module, x):
    return module(x)


def mini_sequence_norm(norm, hidden_states: torch.Tensor, chunk_size: int):
    """``norm(hidden_states)`` one mini-sequence of ``chunk_size`` tokens at a time, through the MLP's
    Function (an RMSNorm is token-wise too): only the input is kept for backward, and the backward
    rebuilds one chunk at a time. Upstream's RMSNorms upcast to fp32, so the unsplit norm's backward
    holds about six fp32 copies of the whole sequence; for the model's final norm that is the step's
    peak with streaming (planner, Llama-3-8B at 100K tokens: 9.5 GiB on top of the saved layer inputs)."""
    return mini_sequence_mlp(norm, hidden_states, chunk_size, forward_fn=_call_module)

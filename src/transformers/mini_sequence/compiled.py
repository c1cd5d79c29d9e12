"""The mini-sequence MLP, MoE block and norms, and the LM head + loss, as one operator each of a compiled graph, so
that a compiled step keeps the memory the eager one saves.

Dynamo cannot trace our chunked Functions (mlp.py, loss.py: their backward or forward takes `torch.autograd.grad` of
each chunk). Traced as checkpointed chunks instead, the chunks' recompute and backward became one graph that inductor
scheduled as it liked: it rebuilt every chunk before it backpropagated through any, so the whole sequence's
intermediates were live at once (measured on the CPU, fp32 Llama d=256, I=1024, one layer, 4K tokens: 66 chunk-sized
tensors live at the compiled step's peak; peak above the step's start 211.4 MiB compiled against 175.4 eager; a bf16
one-layer step with V=16000 at 2K tokens: 107.4 MiB against 42.6, every chunk's logits live). So here each block's
call is a `torch.library` custom operator, opaque to the compiler (`transformers_mst::mini_sequence_chunks_<release>`,
mst_core/custom_ops.py `op_name`): its kernel runs the chunks' forward without graph, its registered backward is a
second operator running the Function's eager backward (one chunk rebuilt, backpropagated and freed at a time). The
compiled graph saves only the block's input and parameters for it, and never needs the operator's output in the
backward, so a checkpointed layer's recompute does not run the block again (as `SavedInput` arranges eagerly,
mst_core/wrappers.py). The LM head + loss (`mini_sequence_loss`) runs loss.py's Functions the same way: the graph
saves the loss's gradients, which their forward computes, or for the vocabulary-sliced one the tokens' log-sum-exp
and the input, for a backward operator.

What crosses the operator boundary: the input, the parameters that require grad, the modules' keys
(mst_core/custom_ops.py, named at model construction), which computation (`KINDS`), the chunk size, and a text with
the autocast state at trace time and the output's dtype and width, which the traced graph needs before the kernel
runs: found by running the block on the input's first token while tracing (those operations are dead code in the
graph, and inductor drops them).

Only where the whole call can cross; otherwise the checkpointed chunks run as before (for the LM head: where torch's
fused `F.linear_cross_entropy` does not apply, loss.py):
- the modules' parameters plain and no hooks (mst_core/wrappers.py `function_parameters`);
- a block that returns one tensor (not GPT-OSS's router scores, nor router logits while the model records them);
- no dropout drawn inside the block (a LoRA dropout in training): the chunks' rebuild must draw the forward's masks,
  which the checkpointed chunks replay; the kernel checks that the forward drew no random numbers and raises if it
  did.
"""

import functools

import torch

from ..mst_core.custom_ops import (
    autocast_entry,
    autocast_in_kernel,
    autocast_text,
    autograd_in_kernel,
    can_run_eager_kernels,
    kernel_autocast_state,
    module_key,
    name_modules,
    named_module,
    op_name,
)
from ..mst_core.fields import MINI_SEQUENCE_FIELD
from ..mst_core.model_checks import CONSTRUCTION_HOOKS, text_config
from ..mst_core.replay import capture_rng_state, restore_autocast_state
from ..mst_core.wrappers import function_parameters


def name_modules_for_compile(model) -> None:
    """At model construction, with the field set: keys for the model's modules (the operators' arguments)."""
    config = text_config(model.config)
    if getattr(config, MINI_SEQUENCE_FIELD, None) is not None:
        name_modules(model.modules())


def _kinds():
    from .mlp import _call_module, _mlp_then_norm, module_forward
    from .moe import _chunk_forward

    return {
        "mlp": lambda modules: (module_forward, modules[0], True),
        "norm": lambda modules: (_call_module, modules[0], True),
        "mlp_then_norm": lambda modules: (_mlp_then_norm, tuple(modules), True),
        # MoE blocks (moe.py): expert gradients summed in their own dtype, as autograd sums them without the field
        "moe": lambda modules: (functools.partial(_chunk_forward, False, False, beside=_second(modules)), modules[0], False),
        "moe_flattened": lambda modules: (
            functools.partial(_chunk_forward, False, True, beside=_second(modules)), modules[0], False),
    }


def _second(modules):
    return modules[1] if len(modules) > 1 else None


def _resolved(keys, kind):
    """(forward_fn, the module argument it takes, whether half-precision gradients are summed in fp32)."""
    return _kinds()[kind]([named_module(key) for key in keys])


def _decode(text):
    autocast, out_dtype, out_width = [], None, None
    for part in filter(None, text.split(";")):
        name, spec = part.split("=", 1)
        if name == "@autocast":
            autocast.append(autocast_entry(spec))
        elif name == "@out":
            dtype, width = spec.split(",")
            out_dtype, out_width = getattr(torch, dtype), int(width)
    return autocast, out_dtype, out_width


def _draws_dropout(modules) -> bool:
    return any(
        isinstance(sub, torch.nn.modules.dropout._DropoutNd) and sub.training and sub.p > 0
        for module in modules for sub in module.modules()
    )


@torch.library.custom_op(op_name("mini_sequence_chunks"), mutates_args=())
def mini_sequence_chunks(
    x: torch.Tensor, params: list[torch.Tensor], keys: list[int], kind: str, chunk_size: int, text: str
) -> torch.Tensor:
    from .mlp import _forward_chunks

    forward_fn, module, _ = _resolved(keys, kind)
    autocast, _, _ = _decode(text)
    rng_before = capture_rng_state(x.device)
    with autocast_in_kernel(autocast), torch.no_grad():
        out = _forward_chunks(forward_fn, module, x, chunk_size)
    if any(
        before is not None and not torch.equal(before, after)
        for before, after in zip(rng_before, capture_rng_state(x.device))
    ):
        raise RuntimeError(
            f"{MINI_SEQUENCE_FIELD} under torch.compile: {' + '.join(type(m).__name__ for m in _modules(module))} drew "
            "random numbers (dropout) in its chunked operator, whose backward could not draw them again. Set its "
            "dropout to 0 in training, or train it without torch.compile, and please report this with your model."
        )
    return out


def _modules(module):
    return module if isinstance(module, tuple) else (module,)


@mini_sequence_chunks.register_fake
def _(x, params, keys, kind, chunk_size, text):
    _, out_dtype, out_width = _decode(text)
    return x.new_empty(x.shape[:-1] + (out_width,), dtype=out_dtype)


@torch.library.custom_op(op_name("mini_sequence_chunks_backward"), mutates_args=())
def mini_sequence_chunks_backward(
    grad: torch.Tensor, x: torch.Tensor, params: list[torch.Tensor], keys: list[int], kind: str, chunk_size: int,
    text: str, needs_x: bool,
) -> list[torch.Tensor]:
    """[the input's gradient (an empty tensor where it needs none), each parameter's gradient]."""
    from .mlp import backward_chunks

    forward_fn, module, fp32_sums = _resolved(keys, kind)
    autocast, _, _ = _decode(text)
    with autograd_in_kernel():
        grad_x, param_grads = backward_chunks(
            x, tuple(params), forward_fn, module, chunk_size, fp32_sums, (grad,), needs_x, [True] * len(params),
            rng_state=capture_rng_state(x.device),  # nothing drew from it (the forward kernel checks)
            autocast_state=kernel_autocast_state(autocast, x.device.type),
        )
    return [grad_x if grad_x is not None else x.new_empty(0), *param_grads]


@mini_sequence_chunks_backward.register_fake
def _(grad, x, params, keys, kind, chunk_size, text, needs_x):
    return [torch.empty_like(x) if needs_x else x.new_empty(0), *(torch.empty_like(p) for p in params)]


def _setup_context(ctx, inputs, output):
    x, params, keys, kind, chunk_size, text = inputs
    ctx.keys, ctx.kind, ctx.chunk_size, ctx.text = keys, kind, chunk_size, text
    ctx.save_for_backward(x, *params)


def _backward(ctx, grad):
    x, *params = ctx.saved_tensors
    needs_x = ctx.needs_input_grad[0]
    grads = mini_sequence_chunks_backward(grad, x, params, ctx.keys, ctx.kind, ctx.chunk_size, ctx.text, needs_x)
    return (grads[0] if needs_x else None), list(grads[1:]), None, None, None, None


mini_sequence_chunks.register_autograd(_backward, setup_context=_setup_context)


def traced_chunks(kind: str, modules, x: torch.Tensor, chunk_size: int):
    """While dynamo traces a training step: `kind`'s computation of `modules` on `x` [..., S, d] as one
    `mini_sequence_chunks` operator of the graph, or None where the call cannot cross (module docstring; the caller
    then takes its checkpointed chunks)."""
    if not (torch.compiler.is_compiling() and torch.is_grad_enabled() and can_run_eager_kernels()):
        return None
    keys = [module_key(module) for module in modules]
    if None in keys or _draws_dropout(modules):
        return None
    params = []
    for module in modules:
        own = function_parameters(module, traced=True)
        if own is None:
            return None
        params += own
    if not (x.requires_grad or params):
        return None
    forward_fn, module, _ = _resolved(keys, kind)
    with torch.no_grad():
        probe = forward_fn(module, x[..., :1, :])  # the output's dtype and width (dead code in the graph)
    if not isinstance(probe, torch.Tensor):
        return None  # more than one output
    out_dtype = str(probe.dtype).removeprefix("torch.")
    text = ";".join(filter(None, [autocast_text(x.device.type), f"@out={out_dtype},{probe.shape[-1]}"]))
    return mini_sequence_chunks(x, params, keys, kind, chunk_size, text)



# The LM head + loss (loss.py) as one operator: its forward kernel runs the chunks and returns what the eager
# Function's backward needs, which the graph saves (the loss's gradients, computed in the forward; or, for the
# vocabulary-sliced Function, each token's log-sum-exp, its backward a second operator).


@torch.library.custom_op(op_name("mini_sequence_loss"), mutates_args=())
def mini_sequence_loss(
    hidden: torch.Tensor, labels: torch.Tensor, divisor: torch.Tensor, params: list[torch.Tensor], key: int,
    chunk_size: int, softcap: float | None, ignore_index: int, vocab_size: int, sliced: bool, needs_hidden: bool,
    text: str,
) -> list[torch.Tensor]:
    """[the loss, then: sliced, each token's fp32 log-sum-exp; else the loss's gradients (loss.py `loss_and_grads`):
    the hidden states' (an empty tensor where none is wanted), each parameter's sum]."""
    from . import loss

    lm_head = named_module(key)
    autocast, _, _ = _decode(text)
    if sliced:
        with autocast_in_kernel(autocast), torch.no_grad():
            return list(loss.sliced_loss(hidden, labels, chunk_size, lm_head, softcap, ignore_index, divisor))
    with autograd_in_kernel(), restore_autocast_state(kernel_autocast_state(autocast, hidden.device.type)):
        value, grad_hidden, sums = loss.loss_and_grads(
            hidden, labels, chunk_size, lm_head, softcap, ignore_index, vocab_size, divisor, params, params, needs_hidden
        )
    return [value, grad_hidden if grad_hidden is not None else hidden.new_empty(0), *sums]


def _sum_dtype(param):
    return torch.float32 if param.dtype in (torch.float16, torch.bfloat16) else param.dtype


@mini_sequence_loss.register_fake
def _(hidden, labels, divisor, params, key, chunk_size, softcap, ignore_index, vocab_size, sliced, needs_hidden, text):
    value = hidden.new_empty((), dtype=torch.float32) / divisor  # the dtype of the fp32 sum / divisor
    if sliced:
        return [value, hidden.new_empty(hidden.shape[0], dtype=torch.float32)]
    grad_hidden = torch.empty_like(hidden) if needs_hidden else hidden.new_empty(0)
    return [value, grad_hidden, *(torch.empty_like(p, dtype=_sum_dtype(p)) for p in params)]


@torch.library.custom_op(op_name("mini_sequence_loss_backward"), mutates_args=())
def mini_sequence_loss_backward(
    grad_total: torch.Tensor, hidden: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, divisor: torch.Tensor,
    params: list[torch.Tensor], key: int, chunk_size: int, softcap: float | None, ignore_index: int,
    needs_hidden: bool, text: str,
) -> list[torch.Tensor]:
    """The vocabulary-sliced loss's backward (loss.py `sliced_grads`): [the hidden states' gradient (an empty tensor
    where none is wanted), the weight's]."""
    from . import loss

    autocast, _, _ = _decode(text)
    # autograd: through a soft-cap
    with autograd_in_kernel(), restore_autocast_state(kernel_autocast_state(autocast, hidden.device.type)):
        grad_hidden, grad_weight = loss.sliced_grads(
            grad_total, hidden, labels, lse, divisor, named_module(key), softcap, ignore_index, chunk_size, needs_hidden
        )
    return [grad_hidden if grad_hidden is not None else hidden.new_empty(0), grad_weight]


@mini_sequence_loss_backward.register_fake
def _(grad_total, hidden, labels, lse, divisor, params, key, chunk_size, softcap, ignore_index, needs_hidden, text):
    return [torch.empty_like(hidden) if needs_hidden else hidden.new_empty(0), torch.empty_like(params[0])]


def _loss_setup_context(ctx, inputs, output):
    hidden, labels, divisor, params, key, chunk_size, softcap, ignore_index, _, sliced, needs_hidden, text = inputs
    ctx.sliced, ctx.needs_hidden, ctx.param_dtypes = sliced, needs_hidden, [p.dtype for p in params]
    ctx.args = (key, chunk_size, softcap, ignore_index, needs_hidden, text)
    if sliced:
        ctx.save_for_backward(hidden, labels, output[1], divisor, *params)
    else:
        ctx.save_for_backward(*output[1:])


def _loss_backward(ctx, grads):
    from .loss import scale_precomputed_grads

    grad_total = grads[0]
    if ctx.sliced:
        hidden, labels, lse, divisor, *params = ctx.saved_tensors
        grad_hidden, *param_grads = mini_sequence_loss_backward(grad_total, hidden, labels, lse, divisor, params,
                                                                *ctx.args)
    else:
        grad_hidden, *sums = ctx.saved_tensors
        grad_hidden, param_grads = scale_precomputed_grads(
            grad_total, grad_hidden if ctx.needs_hidden else None, sums, ctx.param_dtypes, in_place=False
        )
    return (grad_hidden if ctx.needs_hidden else None), None, None, param_grads, *([None] * 8)


mini_sequence_loss.register_autograd(_loss_backward, setup_context=_loss_setup_context)


def traced_loss(lm_head, hidden, labels, divisor, chunk_size, softcap, ignore_index, vocab_size):
    """While dynamo traces a training step: the mini-sequence LM head + loss (loss.py) on `hidden` [N, d] as one
    `mini_sequence_loss` operator of the graph, or None where the call cannot cross (as `traced_chunks`)."""
    if not (torch.compiler.is_compiling() and torch.is_grad_enabled() and can_run_eager_kernels()):
        return None
    key = module_key(lm_head)
    if key is None or _draws_dropout([lm_head]):
        return None
    params = function_parameters(lm_head, traced=True)
    if params is None or not (hidden.requires_grad or params):
        return None
    from .loss import _vocab_sliced_backward_pays

    sliced = _vocab_sliced_backward_pays(lm_head, hidden, params, vocab_size)
    softcap = None if softcap is None else float(softcap)
    outputs = mini_sequence_loss(
        hidden, labels, divisor.to(hidden.device), params, key, chunk_size, softcap, ignore_index, vocab_size, sliced,
        hidden.requires_grad, autocast_text(hidden.device.type),
    )
    return outputs[0]


CONSTRUCTION_HOOKS.append(name_modules_for_compile)

"""Parameter gradients summed chunk by chunk, shared by the chunked Functions (mini_sequence/mlp.py, loss.py,
streaming_backward/layer.py): half-precision gradients summed in fp32 and rounded once, as the unsplit matmul
does, by one fp32-output GEMM per chunk where the backend has one."""

import contextlib
import functools
import threading

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


def accumulate_grads(acc: list, grads) -> None:
    """Add one chunk's parameter gradients into ``acc`` (None entries start the sum).

    Half-precision gradients are summed in fp32 and rounded once by the caller, like the unsplit
    matmul, which also accumulates in fp32 and rounds once (measurement in mlp.py).
    """
    for i, g in enumerate(grads):
        _add_grad(acc, i, g, fp32_sums=True)


def _add_grad(acc: list, i: int, g, fp32_sums: bool) -> None:
    """Add `g` into `acc[i]`. With ``fp32_sums=False`` a half-precision gradient is summed in its own dtype, as
    autograd sums a parameter's gradients (moe.py: the expert weights, whose fp32 sum would cost more memory than it
    saves)."""
    if g is None:
        return
    if acc[i] is None:
        if fp32_sums and g.dtype in (torch.float16, torch.bfloat16):
            acc[i] = g.float()
        else:
            # Summed into in place from here on: not a gradient autograd expanded from a reduction (`p.sum()`'s: one
            # element seen at every position, which an in-place add refuses).
            expanded = any(stride == 0 and size > 1 for stride, size in zip(g.stride(), g.shape))
            acc[i] = g.clone(memory_format=torch.contiguous_format) if expanded else g
    else:
        acc[i].add_(g)


# Slices in which `add_linear_weight_grad` computes a chunk's weight gradient where the backend has no GEMM
# with an fp32 output for half inputs: only 1/8 of a [V, d] gradient exists at a time besides the accumulator.
_WEIGHT_GRAD_SLICES = 8

# (device type, tensor type) whose backend has no kernel for ``addmm(..., out_dtype=torch.float32)`` (the CPU's;
# CUDA has one). Fake tensors have their own entry: the planner's stand-in runs its meta kernel, as the GPU would.
_NO_FP32_OUT_GEMM = set()


def may_have_fp32_out_gemm(tensor) -> bool:
    """False once `add_linear_weight_grad` found no fp32-output GEMM for the backend of tensors like this one."""
    return (tensor.device.type, type(tensor)) not in _NO_FP32_OUT_GEMM


def _fp32_out_addmm(acc, a, b) -> bool:
    """``acc += a @ b`` (``acc`` fp32, ``a`` and ``b`` half precision) by one GEMM with an fp32 output, if the backend
    of ``acc`` has one; False (nothing done) if not."""
    if not may_have_fp32_out_gemm(acc):
        return False
    try:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        return True
    except (NotImplementedError, TypeError):  # no such kernel for this backend, or a torch without out_dtype
        _NO_FP32_OUT_GEMM.add((acc.device.type, type(acc)))
        return False


def add_product_fp32(acc, a, b):
    """``acc += a @ b`` with ``acc`` fp32 and ``a``, ``b`` half precision, the product never rounded to half
    precision: one fp32-output GEMM where the backend has one (CUDA), else GEMMs of fp32 copies (exact: a product of
    two half-precision numbers fits in fp32) written into ``acc`` in place, an eighth of the inner dimension at a
    time, so the copies stay small next to ``acc`` (the operands of one vocabulary slice: mini_sequence/loss.py).
    A half-precision product rounded per slice instead raised the hidden-state gradient's error to 1.33x upstream's
    (8 slices, measured); these fp32 products cost time on a CPU (docs/limits.md)."""
    if _fp32_out_addmm(acc, a, b):
        return
    step = -(-a.shape[1] // _WEIGHT_GRAD_SLICES)
    for start in range(0, a.shape[1], step):
        inner = slice(start, start + step)
        acc.addmm_(a[:, inner].float(), b[inner].float())


def add_linear_weight_grad(acc, grad_out, inputs):
    """``acc += grad_out.T @ inputs`` ([V, C] x [C, d]). A half-precision chunk into an fp32 accumulator is one
    GEMM with an fp32 output where the backend has one (CUDA): the product is never rounded to half precision
    and nothing besides the accumulator is written. Measured on an H100 (docs/cuda/README.md): 0.68-0.78x the
    time of the product and the fp32 add, for the LM head's and the MLP's weights. Elsewhere in slices of the
    V output features: besides the accumulator only one slice's product exists (in the inputs' dtype, so it is
    rounded once, as autograd's would be), not a whole [V, d] gradient per chunk."""
    if acc.dtype == torch.float32 and grad_out.dtype != acc.dtype and _fp32_out_addmm(acc, grad_out.T, inputs):
        return
    step = -(-acc.shape[0] // _WEIGHT_GRAD_SLICES)
    for start in range(0, acc.shape[0], step):
        rows = slice(start, start + step)
        if acc.dtype == grad_out.dtype:
            acc[rows].addmm_(grad_out[:, rows].T, inputs)
        else:
            acc[rows].add_(grad_out[:, rows].T @ inputs)


def add_weight_grad_into_sums(sums: list, index: int, weight, grad_out, rows) -> None:
    """``grad_out^T @ rows`` (grad_out [N, out], rows [N, in]), the linear layer's weight gradient, into ``sums[index]``
    (fp32, created at the first chunk)."""
    if sums[index] is None:
        sums[index] = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    add_linear_weight_grad(sums[index], grad_out, rows)


class _LinearIntoWeightSums(torch.autograd.Function):
    """``F.linear(rows, weight, bias)`` (rows [N, in]) whose weight gradient goes into ``sums[index]``, not to
    autograd; the gradients of ``rows`` and ``bias`` are the linear layer's. Its output is a tensor of its own, not a
    view of one: upstream code may write into it (Llama-4's MoE block adds its routed experts' output into its shared
    expert's in place, which autograd refuses on a custom Function's view)."""

    @staticmethod
    def forward(ctx, rows, weight, bias, sums, index):
        ctx.save_for_backward(rows, weight)
        ctx.sums, ctx.index = sums, index
        return F.linear(rows, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        rows, weight = ctx.saved_tensors
        add_weight_grad_into_sums(ctx.sums, ctx.index, weight, grad_out, rows)
        grad_rows = grad_out @ weight if ctx.needs_input_grad[0] else None
        grad_bias = grad_out.sum(0) if ctx.needs_input_grad[2] else None
        return grad_rows, None, grad_bias, None, None


class LinearWeightGradsSummed(TorchFunctionMode):
    """While active (a Function's recomputation of one chunk in its backward), ``F.linear(x, w, b)`` with ``w`` a
    half-precision matrix among ``params`` (and ``x`` in its dtype, outside autocast) runs in `_LinearIntoWeightSums`,
    and ``w``'s gradient goes straight into ``sums`` (fp32, `_add_grad`'s sums) by one fp32-output GEMM per call where
    the backend has one (`add_linear_weight_grad`): autograd never computes a half-precision ``[out, in]`` product
    for ``w`` to be added into the fp32 sum. Any other use of ``w`` still reaches it through autograd
    (`summed_as_computed`). ``seen`` holds the indices taken over, whose gradient autograd may then leave None.
    This is the linear layer's weight gradient and nothing else: the module's own forward runs unchanged. Used by the
    mini-sequence MLP Function and by a streamed layer's backward, for their recomputation of one chunk."""

    def __init__(self, sums: list, params):
        super().__init__()
        self.sums = sums
        self.params = params
        half = (torch.float16, torch.bfloat16)
        self.index = {id(p): i for i, p in enumerate(params) if p.dtype in half and p.dim() == 2}
        self.seen = set()

    def takes(self, x, weight):
        """The index of `weight` among `params` if this mode takes its gradient in ``F.linear(x, weight, ...)`` (a
        half-precision matrix, `x` in its dtype, outside autocast, grad enabled), else None."""
        # Not under no_grad (e.g. a chunked Function's own forward inside the recomputed chunk): nothing to take.
        i = self.index.get(id(weight)) if self.index and torch.is_grad_enabled() else None
        if i is None or self.params[i] is not weight or x.dtype != weight.dtype or torch.is_autocast_enabled(x.device.type):
            return None
        self.seen.add(i)
        return i

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x = args[0] if args else kwargs.get("input")
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            i = self.takes(x, weight)
            if i is not None:
                bias = args[2] if len(args) > 2 else kwargs.get("bias")
                # Rows folded into one matrix, as matmul folds them when the weight needs a gradient: with the
                # weight detached it would not fold a chunk (a strided view of the sequence) and run bmm instead
                # (seen on an H100: 512 bmm calls, 47 ms a step at 16K tokens).
                rows = x.reshape(-1, x.shape[-1])  # [*, in] -> [N, in]
                out = _LinearIntoWeightSums.apply(rows, weight, bias, self.sums, i)
                return out.view(*x.shape[:-1], out.shape[-1])  # [N, out] -> [*, out]
        return func(*args, **kwargs)


def linear_weight_grads_summed(sums: list, params, like: torch.Tensor):
    """`LinearWeightGradsSummed(sums, params)` for one chunk's recomputation where it may take a gradient: a
    half-precision matrix among `params`, autocast off, and a backend that may have an fp32-output GEMM for tensors
    like `like`; else None. A mode that can take nothing would still see every torch call of the chunk (a Python
    call each: about 100 per streamed layer chunk, fp32 or autocast training)."""
    if torch.is_autocast_enabled(like.device.type) or not may_have_fp32_out_gemm(like):
        return None
    mode = LinearWeightGradsSummed(sums, params)
    return mode if mode.index else None


_summing = threading.local()  # the active `summed_as_computed` contexts of this thread, innermost last


@contextlib.contextmanager
def summed_as_computed(acc: list, params, fp32_sums=True):
    """While active, each gradient autograd computes for ``params[i]`` is added into ``acc[i]`` (`accumulate_grads`)
    the moment it exists, by a tensor hook that hands autograd a zero of no storage in its place. ``fp32_sums``: whether
    half-precision gradients are summed in fp32 (`_add_grad`), for all parameters or one bool per parameter.

    Why: `torch.autograd.grad` holds every gradient of a chunk until the chunk's whole backward is done, so one
    chunk's parameter gradients and the running sum lived together with the rest of that backward's temporaries.
    Autograd's own accumulation adds each gradient as soon as it is computed, and so do these hooks: measured on a
    bf16 Mixtral MoE block (16 experts, d=256, 2048 tokens, chunks of 256), the block's backward peak went from 38.7
    to 22.8 MiB (the same chunks checkpointed, summed by autograd: 29.3 MiB).

    Nested (one chunked Function's recompute running another, both summing the same weights; the streamed layer runs
    the mini-sequence MLP unsplit since mst.16, mst_core/chunks.py): only the innermost context takes a gradient; the
    outer one passes it on, and takes the inner Function's result when autograd delivers it."""
    stack = _summing.__dict__.setdefault("stack", [])
    me = object()
    zeros = {}  # index -> the zero of no storage handed back in its place: made once, not per chunk (2 calls each)

    def add(index, grad):
        if grad is None or stack[-1] is not me:
            # None: the weight was only used by linear layers that `LinearWeightGradsSummed` took over.
            # Not innermost: an inner context's computation, which sums this one.
            return None
        _add_grad(acc, index, grad, fp32_sums if isinstance(fp32_sums, bool) else fp32_sums[index])
        if index not in zeros:  # a parameter's gradient always has its shape, dtype and device
            zeros[index] = grad.new_zeros(()).expand_as(grad)
        return zeros[index]

    handles = [param.register_hook(functools.partial(add, i)) for i, param in enumerate(params)]
    stack.append(me)
    try:
        yield
    finally:
        stack.remove(me)
        for handle in handles:
            handle.remove()

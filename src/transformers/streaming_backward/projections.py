"""The attention's projections before the cache, run once in a streamed layer's backward, not twice.

The backward first recomputes every chunk's K/V without graph (the layer stopped at the cache, layer.py), then
recomputes each chunk with graph. Without this module the projections that run before the cache (k_proj, v_proj, a
fused qkv_proj) would see each token a third time in that second recompute. Instead the K/V pass records their
outputs, chunk by chunk, and the chunk's recompute gets the recorded output back from a Function whose backward is
the linear layer's (`_RecordedLinear`): the layer's own forward still runs (its K-norm, RoPE, ... on the recorded
projection), only the matrix product is not done again. Each projection then sees each token twice a step, as
under checkpointing (forward and backward's K/V pass).

Cost: the recorded outputs of one layer (K+V sized for k_proj/v_proj), from the K/V pass until each chunk's turn
(chunks go from the last to the first, and each one's records are freed after it).

Only a module whose forward is `nn.Linear.forward` itself (no subclass forward, no hooks): a 4-bit layer, a LoRA
wrapper or anything else runs as before. A LoRA wrapper's own plain base layer and adapter matrices are plain
Linears and are recorded; its dropout draws the same mask in both passes (each replays the forward's RNG state).
"""

import contextlib

import torch

from ..mst_core.grads import LinearWeightGradsSummed, add_weight_grad_into_sums
from .cache import runs_its_class_forward


def recordable_projections(attn, skipped=None):
    """The plain `nn.Linear` modules inside `attn` (the attention module) other than `skipped` (the query projection
    the K/V pass skips, cache.queries_not_computed)."""
    return [
        module for module in attn.modules()
        if module is not skipped and type(module).forward is torch.nn.Linear.forward
        and runs_its_class_forward(module)
    ]


class RecordedProjections:
    """Per chunk, the outputs of the projections the K/V pass ran: `recording(index)` while the pass runs chunk
    `index`; `replaying(index, linear_sums)` while that chunk is recomputed with graph; `release(index)` after the
    chunk's last recompute."""

    def __init__(self, projections):
        self.projections = projections
        self.records = {}  # chunk index -> {module: [(output, its version counter at recording)]}

    @contextlib.contextmanager
    def recording(self, index):
        records = self.records[index] = {}

        def recorder(module):
            def forward(x):
                out = torch.nn.Linear.forward(module, x)
                records.setdefault(module, []).append((out, out._version))
                return out

            return forward

        with _forwards_replaced({module: recorder(module) for module in self.projections}):
            yield

    @contextlib.contextmanager
    def replaying(self, index, linear_sums=None):
        """Each recorded module returns its recorded outputs in the order they were recorded; one changed in place
        since (its version counter moved: upstream code wrote into it) or not recorded is computed as usual."""
        records = {module: list(outs) for module, outs in self.records.get(index, {}).items()}

        def replayer(module):
            def forward(x):
                outs = records[module]
                out, version = outs.pop(0) if outs else (None, None)
                expected = x.shape[:-1] + (module.out_features,)
                if out is None or out._version != version or out.shape != expected:
                    return torch.nn.Linear.forward(module, x)
                return replayed_linear(x, module.weight, module.bias, out, linear_sums)

            return forward

        with _forwards_replaced({module: replayer(module) for module in records}):
            yield

    def release(self, index):
        self.records.pop(index, None)


@contextlib.contextmanager
def _forwards_replaced(forwards):
    for module, forward in forwards.items():
        module.forward = forward
    try:
        yield
    finally:
        for module in forwards:
            del module.forward


def replayed_linear(x, weight, bias, recorded, linear_sums=None):
    """`F.linear(x, weight, bias)` for an input whose output is `recorded` (computed from the same `x` and weight
    without graph): returns `recorded` with the graph of a linear layer. Under autocast the inputs are cast as
    autocast casts them (the casts on the graph, so their gradients are cast back); a half-precision weight that
    `linear_sums` (mst_core/grads.LinearWeightGradsSummed) takes gets its gradient there, as a computed linear
    would."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    rows = x.reshape(-1, x.shape[-1])  # [*, in] -> [N, in]
    taken = linear_sums.takes(rows, weight) if isinstance(linear_sums, LinearWeightGradsSummed) else None
    sums = None if taken is None else linear_sums.sums
    out = _RecordedLinear.apply(rows, weight, bias, recorded.reshape(-1, recorded.shape[-1]), sums, taken)
    return out.view(*x.shape[:-1], out.shape[-1])


class _RecordedLinear(torch.autograd.Function):
    """Forward: `recorded` ([N, out], equal to rows @ weight.T + bias), as a tensor of its own (not a view: upstream
    code may write into a projection's output in place, which autograd refuses on a custom Function's view).
    Backward: the linear layer's gradients; with `sums` given, the weight's goes into ``sums[index]`` (fp32,
    mst_core/grads.LinearWeightGradsSummed) and autograd gets None for it."""

    @staticmethod
    def forward(ctx, rows, weight, bias, recorded, sums, index):
        ctx.save_for_backward(rows, weight)
        ctx.has_bias, ctx.sums, ctx.index = bias is not None, sums, index
        return recorded.detach()  # shares storage and version counter with the record, no autograd view

    @staticmethod
    def backward(ctx, grad):
        rows, weight = ctx.saved_tensors
        grad_rows = grad @ weight if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.sums is not None:
            add_weight_grad_into_sums(ctx.sums, ctx.index, weight, grad, rows)
        elif ctx.needs_input_grad[1]:
            grad_weight = grad.T @ rows
        grad_bias = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_rows, grad_weight, grad_bias, None, None, None

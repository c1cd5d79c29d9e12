"""MoE router logits (`output_router_logits=True`, the auxiliary load-balancing loss) through a streamed layer.

In 5.24 a forward hook on the router module appends its logits to the running forward's collector
(utils/output_capturing.py). Run per query chunk, and without graph in the streamed forward, that would record one
entry per chunk and nothing the auxiliary loss could backpropagate through. So each chunk call of the layer sets a
collector of its own (`chunk_collector`), and the streamed layer returns the whole sequence's logits, token-major
[batch * S, experts] as the unsplit router records them, as one more output of its Function (or of its checkpointed
fallback). The model's collector gets that once, with graph (`hand_over`); in the backward each chunk's recomputed
logits take their rows of its gradient, in the same `autograd.grad` as the chunk's output.
"""

import contextlib

import torch

from ..mst_core.custom_ops import named_module
from ..mst_core.fields import STREAMING_FIELD
from ..mst_core.router_logits import ROUTER_LOGITS, is_output_capturing_hook, own_router_collector
from ..utils import output_capturing


# Outputs a streamed call lets upstream record: those its hooks on the decoder layer itself record, around the call,
# and the router logits, which this module hands over (checks.py refuses any other; compiled.py runs them eagerly).
HANDLED_OUTPUTS = ("hidden_states", "_hidden_states_layers", ROUTER_LOGITS)


def model_collector():
    """The running model forward's output collector, or None (read once per streamed layer call)."""
    variable = output_capturing._active_collector
    if torch.compiler.is_compiling() and not variable.compiling:
        # Dynamo cannot read the ContextVar; a model forward that records outputs set the variable while being traced
        # (`compiling`). One that did not (Mamba2's records none) has no collector.
        return None
    return variable.get()


def recording(collector) -> bool:
    """Whether `collector` (model_collector) records router logits."""
    return collector is not None and ROUTER_LOGITS in collector


@contextlib.contextmanager
def chunk_collector(records: bool):
    """While the model records router logits, the collector the layer's hooks append to during one chunk call
    (mst_core/router_logits.own_router_collector); else nothing changes (no other key is recorded inside a streamed layer:
    checks.check_captured_outputs)."""
    if not records:
        yield None
        return
    with own_router_collector() as collected:
        yield collected


def chunk_logits(collected, layer, batch: int, rows: int):
    """The one router output a chunk call recorded ([batch * rows, experts]), or None (no router in this layer, or the
    layer stopped at the cache)."""
    if not collected or not collected[ROUTER_LOGITS]:
        return None
    logits = collected[ROUTER_LOGITS]
    if len(logits) != 1 or logits[0].dim() != 2 or logits[0].shape[0] != batch * rows:
        raise ValueError(
            f"{STREAMING_FIELD}: {type(layer).__name__} recorded {len(logits)} router outputs of shape "
            f"{tuple(logits[0].shape)} for a chunk of {batch} x {rows} tokens; the streamed layer handles one "
            "[tokens, experts] router output per layer. Train without output_router_logits, or unset the field."
        )
    return logits[0]


@torch.compiler.assume_constant_result  # run, not traced, while dynamo traces: it reads the hooks' closures
def experts_recorded(key: int):
    """The number of experts whose logits the layer named `key` (mst_core/custom_ops.module_key) records: the rows of
    the 2-D weight of its one router-logits recorder (Mixtral's, Qwen3-MoE's, GPT-OSS's `TopKRouter`: [experts,
    hidden]); 0 for a layer without one (a dense layer of an MoE model); None where neither can be told (compiled.py
    then runs the call eagerly). Fixed for a layer: a module's hooks are installed once. Named by its key: dynamo in
    torch 2.11 cannot hand a module to a function it runs untraced (it raised there)."""
    layer = named_module(key)
    routers = [module for module in layer.modules()
               if any(is_output_capturing_hook(hook, ROUTER_LOGITS) for hook in module._forward_hooks.values())]
    if not routers:
        return 0
    weight = getattr(routers[0], "weight", None) if len(routers) == 1 else None
    return weight.shape[0] if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None


def hand_over(result):
    """The streamed layer's result: its output, and the router logits (if any) appended to the model's collector."""
    if not isinstance(result, tuple):
        return result
    out, logits = result
    output_capturing._active_collector.get()[ROUTER_LOGITS].append(logits)
    return out

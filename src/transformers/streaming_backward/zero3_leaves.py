"""DeepSpeed ZeRO-3 leaf modules inside a streamed layer: their gradients queued for reduction once per layer call.

DeepSpeed flags some modules as ZeRO-3 leaf modules (by default, `zero_optimization.leaf_module`: the sparse MoE
blocks of Mixtral, Qwen2-MoE and Qwen3-MoE). It gathers a leaf module's weights as one unit and queues all their
gradients for reduce-scatter from one full backward hook on the module (stage3.py `reduce_leaf_module_grads`),
which autograd fires once per call of the module: DeepSpeed expects one call per backward. Under ZeRO-3 a streamed
layer takes the nested-checkpoint fallback (layer.py `_forward_with_checkpoints`), which calls the layer's forward,
so its MoE block, once per query chunk: the hook fired once per chunk, each time queuing every weight of the block
again, the first times before the other chunks' gradients had been added (DeepSpeed asserted in
`__reduce_and_partition_ipg_grads`: a parameter twice in one bucket).

A parameter's `ds_grad_is_ready = False` is DeepSpeed's own switch for a module called several times per backward
(its tiled MLP sets it for every tile but the last): the hook then leaves that gradient to accumulate. Here the calls
of each leaf module in a streamed layer's forward are counted, and a hook that runs before DeepSpeed's sets the
flag on the module's weights: False at every firing but the last. The last one queues each gradient once, with every
chunk's part added (as DeepSpeed's hook expects of a module called once); after it the flag stays True (unset, it
means True), so calls outside a streamed layer's forward are DeepSpeed's as before.
"""

import contextlib
import contextvars

import torch


_PENDING = "_mst_streamed_firings"  # on a leaf module: how many of its backward firings are still to come
_counting = contextvars.ContextVar("mst_streamed_zero3_leaves", default=None)


def zero3_leaf_modules(layer):
    """The modules inside `layer` (not itself) that DeepSpeed ZeRO-3 treats as leaf modules (its `_z3_leaf` flag).
    Walked through `_modules` dicts, not `modules()`: dynamo breaks the graph at a generator's `next`, and this runs
    on every streamed layer call, compiled ones included."""
    leaves, pending = [], list(layer._modules.values())
    while pending:
        module = pending.pop()
        if module is None:
            continue
        if getattr(module, "_z3_leaf", False) and any(hasattr(p, "ds_id") for p in module.parameters()):
            leaves.append(module)
        pending.extend(module._modules.values())
    return leaves


@contextlib.contextmanager
def leaf_gradients_queued_once(layer):
    """Around a streamed layer's forward with graph (not its recomputations, which run in the backward and are not
    backpropagated through): counts each leaf module's completed calls, i.e. its firings in the backward (a call
    stopped at the cache returns no output, and its full backward hook never fires)."""
    leaves = zero3_leaf_modules(layer)
    if not leaves:
        yield
        return
    for module in leaves:
        if _PENDING not in vars(module):
            module.register_forward_hook(_count_call)
            module.register_full_backward_hook(_ready_at_last_firing, prepend=True)  # before DeepSpeed's
        setattr(module, _PENDING, 0)
    token = _counting.set(frozenset(map(id, leaves)))
    try:
        yield
    finally:
        _counting.reset(token)


def _count_call(module, args, output):
    if id(module) in (_counting.get() or ()) and torch.is_grad_enabled():
        setattr(module, _PENDING, getattr(module, _PENDING) + 1)


def _ready_at_last_firing(module, grad_input, grad_output):
    pending = getattr(module, _PENDING) - 1
    setattr(module, _PENDING, pending)
    for param in module.parameters():
        param.ds_grad_is_ready = pending <= 0

"""Which parameters a chunked autograd Function may take as inputs, under any training wrapper.

Our Functions (mlp.py, loss.py) take the module's parameters as explicit inputs and return their
gradients, computed chunk by chunk with fp32 sums, so that every gradient arrives once. That is
only right when the tensors collected before the call are the tensors the module's forward will
use. Training wrappers break this in three ways, each measured with the flag on:

- DeepSpeed ZeRO-3 gathers a partitioned weight in a forward pre-hook of each Linear: before the
  call its data is empty, so the Function saw `[0]`-shaped inputs and autograd rejected the
  gradient (`... expected shape compatible with [0]`).
- FSDP2 with a module as its own `fully_shard` unit swaps the sharded DTensor parameters for
  unsharded ones in a pre-hook: the collected (sharded) parameters were not used, and
  `allow_unused=True` turned that into a silent `None` gradient.
- FSDP1 (and accelerate offload) install the weights as plain tensor attributes (views of a
  flat parameter): `module.parameters()` is empty, and the weights silently got no gradient.

So: `function_parameters(module)` returns the parameters only when nothing can swap them (no
module hooks, no replaced forward, every weight a registered leaf `nn.Parameter` of plain type, or
its FakeTensor twin when the planner runs under FakeTensorMode);
otherwise it returns None and the caller takes `checkpointed_chunks`, which routes every gradient
through ordinary autograd (non-reentrant checkpointing of each chunk: same memory, one
recomputation per chunk), so whatever the wrapper does to its parameters, autograd delivers the
gradient the wrapper expects. And in the Function path, `check_graph_inputs` walks the recomputed
graph once and raises if it reaches a tensor that requires grad and is not an input, so a
gradient can never disappear silently.
"""

import functools
import sys

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.nn.modules import module as _module_globals
from torch.utils.checkpoint import checkpoint


def _is_fsdp1_unit(module: torch.nn.Module) -> bool:
    """An FSDP1 unit gathers its weights in its own forward (no hooks to see) and swaps them in. Where torch's
    FSDP1 module was never imported no module can be one (looked up, not imported: cheap, and traceable)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(module, fsdp.FullyShardedDataParallel)


def _has_hooks(module: torch.nn.Module, harmless_hook=None) -> bool:
    forward_hooks = [h for h in module._forward_hooks.values() if harmless_hook is None or not harmless_hook(h)]
    return _is_fsdp1_unit(module) or bool(
        module._forward_pre_hooks
        or forward_hooks
        or module._backward_pre_hooks
        or module._backward_hooks
        or "forward" in module.__dict__  # accelerate's add_hook_to_module replaces forward
    )


def is_plain_parameter(param: torch.Tensor) -> bool:
    if not param.is_leaf or hasattr(param, "ds_id"):
        return False  # non-leaf views; DeepSpeed ZeRO-3 partitioned parameter
    if type(param) is torch.nn.Parameter:
        return True
    # Under FakeTensorMode (any run on fake tensors; the planner's is one) `nn.Parameter(fake)` stays a FakeTensor
    # flagged `_is_param`: the fake twin of a plain parameter. Other subclasses (DTensor: FSDP2 sharded) are not plain.
    return type(param) is FakeTensor and getattr(param, "_is_param", False)


def _holds_plain_tensor_weight(module: torch.nn.Module) -> bool:
    """Whether `module` has a weight installed as a plain attribute, not a parameter (FSDP1's flat-parameter views
    during its forward). While torch.compile traces, FSDP1's own mark on the modules it manages says so: dynamo in
    torch 2.11 cannot iterate a module's `__dict__` (a graph break at every chunked block, measured on an H200)."""
    if torch.compiler.is_compiling():
        return getattr(module, "_is_fsdp_managed_module", False)  # torch/distributed/fsdp/_dynamo_utils.py
    return any(isinstance(value, torch.Tensor) and value.requires_grad for value in vars(module).values())


def function_parameters(module: torch.nn.Module, harmless_hook=None, traced=False) -> list | None:
    """The parameters of `module` that require grad, if a Function may take them as inputs; else None.

    None means some wrapper may change, at call time, which tensors the forward uses, or that torch.compile is
    tracing: the caller must let autograd see the real forward (see `checkpointed_chunks`). A forward hook for which
    `harmless_hook(hook)` is true does not count (router_logits.is_output_capturing_hook: upstream's router-logits
    recorder, which the chunked callers handle).
    """
    if _module_globals._global_forward_pre_hooks or _module_globals._global_forward_hooks:
        return None
    if torch.compiler.is_compiling() and not traced:
        # torch.compile cannot trace a Function whose backward calls autograd.grad (it would break the
        # graph at every call); checkpointed chunks are traced as checkpoint regions instead, or a custom operator
        # takes the parameters (`traced`: mini_sequence/compiled.py).
        return None
    for sub in module.modules():
        if _has_hooks(sub, harmless_hook) or _holds_plain_tensor_weight(sub):
            return None
    params = [p for p in module.parameters() if p.requires_grad]
    if not all(is_plain_parameter(p) for p in params):
        return None
    return params


def call_hooks_once(module: torch.nn.Module, loop, *args):
    """`loop(*args)` as if it were `module(*args)`: the module's own hooks run once around it.

    A chunk loop that calls `module(chunk)` would run the hooks once per chunk: an FSDP2 unit (or a
    ZeRO-3 module) would gather and free its weights per chunk, measured 8 instead of 2 all-gathers
    of an FSDP2-wrapped `lm_head` with 4 chunks. Instead the module is called once with `loop` as its
    forward: pre-hooks gather (and register the post-backward hook on the inputs), post-hooks
    register the pre-backward gather on the output, which precedes every chunk's backward. `loop`
    calls `raw_forward(module)` per chunk. A module whose `forward` is already replaced (accelerate)
    keeps its per-call behaviour: its hooks live inside that forward. For an FSDP1 unit, `loop`
    replaces the wrapped module's forward, so the unit gathers once around it.
    """
    inner = _innermost(module)
    if "forward" in inner.__dict__:
        return loop(*args)
    if torch.compiler.is_compiling() and not (
        _has_hooks(module) or _module_globals._global_forward_pre_hooks or _module_globals._global_forward_hooks
    ):
        return loop(*args)  # nothing to run once around it; swapping `forward` while tracing is not traceable
    inner.forward = loop
    try:
        return module(*args)
    finally:
        del inner.forward


def raw_forward(module: torch.nn.Module):
    """The module's class forward, without its hooks (see `call_hooks_once`); the module itself when
    its forward was replaced."""
    inner = _innermost(module)
    if "forward" in inner.__dict__:
        return module
    return functools.partial(type(inner).forward, inner)


def _innermost(module: torch.nn.Module) -> torch.nn.Module:
    """The module an FSDP1 unit wraps (FSDP1 gathers in its own forward, then calls it), else itself."""
    while _is_fsdp1_unit(module):
        module = module._fsdp_wrapped_module
    return module


def check_graph_inputs(output: torch.Tensor, inputs, where: str) -> None:
    """Raise if the autograd graph of `output` reaches a leaf that requires grad but is not one of
    `inputs`: its gradient would be silently dropped by `autograd.grad(output, inputs)`."""
    wanted = {id(t) for t in inputs}
    seen, stack = set(), [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)  # AccumulateGrad nodes hold their leaf tensor
        if leaf is not None:
            if id(leaf) not in wanted:
                raise RuntimeError(
                    f"{where}: the computation uses a tensor of shape {tuple(leaf.shape)} that requires grad "
                    "but is not among the parameters the chunked Function was given, so its gradient would be "
                    "lost. A wrapper or hook swapped the module's weights; please report this with your setup."
                )
            continue
        stack.extend(next_node for next_node, _ in node.next_functions)


def refuse_create_graph(where: str, flag: str = "mini_sequence_chunk") -> None:
    """Call first in a Function's backward. Grad mode is on there only under `create_graph=True`
    (double backward, gradient penalties): our chunked backward is not differentiable, and returning
    gradients without a graph would make their own gradient silently zero."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{where}: backward with create_graph=True (double backward) is not supported by the chunked "
            f"path; unset {flag} for higher-order gradients."
        )


def require_gradients(grads, inputs, where: str) -> None:
    """Raise if a wanted input got no gradient (instead of passing `None` on silently)."""
    for grad, tensor in zip(grads, inputs):
        if grad is None:
            raise RuntimeError(
                f"{where}: a tensor of shape {tuple(tensor.shape)} that requires grad got no gradient from "
                "the recomputed chunk; refusing to return a missing gradient."
            )


class SavedInput(torch.autograd.Function):
    """Identity that saves its input, for a chunked computation that reads it from this node
    (``x.grad_fn.saved_tensors``) instead of saving it itself or handing it to a checkpoint.

    Why: under non-reentrant activation checkpointing (upstream's `gradient_checkpointing`), the layer's
    backward recomputes its forward only until every tensor the first forward saved is back, then stops
    (torch.utils.checkpoint's early stop). A Function's own saved tensors are packed after its forward has
    run, and the inputs of a nested checkpoint count as saved by the layer's (torch/utils/checkpoint.py, "Rule
    2"): either way the recompute would run the chunked forward (whose output nothing needs) before stopping,
    and the chunks' backward then rebuilds every chunk once more: each token through the block 3 times a step
    instead of checkpointing's 2. Saved by this node, before the chunks, the input is the layer's last saved
    tensor, and the recompute stops before the block (a later op of the layer that saved the block's output
    would need it back: Gemma-2/3's and OLMo-2's post-feedforward norm, mini_sequence/mlp.py)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class ChunkSource:
    """What the checkpointed chunks of one call read a tensor from, in place of a tensor input (which torch would save
    to the enclosing checkpoint, see `SavedInput`): in the forward the `SavedInput` output itself; in a chunk's
    recompute the tensor that node saved, unpacked once (an enclosing checkpoint hands a recomputed tensor out once)
    and shared by the `reads` recomputes that read it (one per chunk), then let go. For a tensor that requires grad
    (`saved_once` below); `forward_done()` after the chunks' forward."""

    def __init__(self, saved: torch.Tensor, reads: int):
        self.forward_input, self.node, self.reads = saved, saved.grad_fn, reads
        self.recomputed, self.remaining = None, reads

    def tensor(self) -> torch.Tensor:
        if self.forward_input is not None:
            return self.forward_input
        if self.recomputed is None:
            (x,) = self.node.saved_tensors
            # As in the forward (the recompute must save what the forward saved: a product saves the weight only
            # for an input that requires grad); its graph is the forward's, through this node.
            self.recomputed = x.detach().requires_grad_()
        x = self.recomputed
        self.remaining -= 1
        if self.remaining == 0:  # every chunk recomputed: hold nothing until another backward
            self.recomputed, self.remaining = None, self.reads
        return x

    def forward_done(self):
        self.forward_input = None


def saved_once(x: torch.Tensor, reads: int) -> ChunkSource:
    """A `ChunkSource` of `x` (which requires grad) read by `reads` checkpointed chunks."""
    return ChunkSource(SavedInput.apply(x), reads)


def checkpointed_chunks(fn, x: torch.Tensor, chunk_size: int, dim: int = -2) -> list:
    """`[fn(chunk, start, end) for each chunk of x along dim]`, each call under non-reentrant
    activation checkpointing: only the chunk's input is kept, its intermediates are rebuilt in
    backward one chunk at a time (RNG and autocast state replayed by torch), and parameter
    gradients flow through ordinary autograd: wrapper hooks see them, and the engine sums each
    parameter's chunk gradients before accumulating it once.

    An input that requires grad is saved once, by `SavedInput`, and the chunks' checkpoints read it from there
    (`ChunkSource`): under the layer's own checkpoint its recompute then stops before the chunks, and each token
    goes through `fn` twice a step (the forward, the chunk's recompute), as checkpointing runs the unsplit block."""
    bounds = [(start, min(start + chunk_size, x.shape[dim])) for start in range(0, x.shape[dim], chunk_size)]
    if not x.requires_grad or torch.compiler.is_compiling():  # traced: AOTAutograd chooses what to recompute
        return [checkpoint(fn, x.narrow(dim, start, end - start), start, end, use_reentrant=False)
                for start, end in bounds]
    source = saved_once(x, len(bounds))

    def chunk_call(source, start, end):
        return fn(source.tensor().narrow(dim, start, end - start), start, end)

    outputs = [checkpoint(chunk_call, source, start, end, use_reentrant=False) for start, end in bounds]
    source.forward_done()
    return outputs

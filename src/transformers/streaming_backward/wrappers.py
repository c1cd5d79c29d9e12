"""Whether the streamed layer's autograd Function may take a decoder layer's parameters as its inputs.

It may when they are plain, hook-free leaf parameters while the layer runs (one process, DDP, PEFT LoRA, FSDP2 with
decoder layers as units: its pre-forward hook has already swapped in unsharded plain parameters;
mst_core/wrappers.py has the rules). When a wrapper may swap the weights inside the layer (ZeRO-3's
per-module gathers, FSDP1's flat-parameter views, FSDP2 or accelerate hooks on the attention module), the layer
takes the autograd fallback instead (layer.py `_forward_with_checkpoints`), so autograd delivers every gradient
the wrapper expects.
"""

import contextlib

import torch

from ..mst_core.router_logits import ROUTER_LOGITS, is_output_capturing_hook
from ..mst_core.wrappers import function_parameters, is_plain_parameter
from .parts import attention_module


def layer_parameters(layer, mixer=None):
    """The layer's parameters that require grad if the Function may take them as inputs, else None. `mixer`: the
    module that meets the cache (default: the attention, `layer.self_attn`; a recurrent layer's mixer, recurrent.py).

    Checked per child module rather than on the layer: transformers installs output-capturing hooks on decoder
    layers and attention modules (output_hidden_states), which only read the outputs.
    """
    attn = attention_module(layer) if mixer is None else mixer
    path = _modules_holding(layer, attn)  # the layer's modules that hold `attn` (Zamba2's shared block), outermost first
    if any(foreign_attention_hooks(module) for module in (*path[1:], attn)):
        return None
    modules = [child for owner in path for child in owner.children() if child is not attn and child not in path]
    params = []
    for module in [*modules, *attn.children()]:
        # The router's logits recorder runs per chunk with the collector the streamed layer sets (router.py).
        module_params = function_parameters(module, harmless_hook=_records_router_logits)
        if module_params is None:
            return None
        params += module_params
    for owner in (*path, attn):  # their own parameters (GPT-OSS's attention sinks): plain ones only
        for value in vars(owner).values():
            if isinstance(value, torch.Tensor) and value.requires_grad:
                return None  # a weight installed as a plain attribute (FSDP1's parameter views)
        for param in owner.parameters(recurse=False):
            if param.requires_grad:
                if not is_plain_parameter(param):
                    return None  # FSDP1's FlatParameter, a DTensor, a ZeRO-3 parameter
                params.append(param)
    return params


def _modules_holding(layer, attn) -> list:
    """[layer, ..., attn's parent]: the modules from the layer down to the one holding `attn` as a child (`[layer]`
    where the layer holds it itself)."""
    path = [layer]
    while not any(child is attn for child in path[-1].children()):
        path.append(next(child for child in path[-1].children() if any(m is attn for m in child.modules())))
    return path


def _records_router_logits(hook) -> bool:
    return is_output_capturing_hook(hook, ROUTER_LOGITS)


def _is_idle_zero3_hook(attn, hook) -> bool:
    """DeepSpeed ZeRO-3 hooks every module; a module's hooks gather (and release, and prepare the backward of) only
    the parameters it holds itself, unless it is a ZeRO-3 leaf module. An attention module holding none gathers
    nothing: its hooks change no weight (the projections' own hooks gather theirs)."""
    return (
        (getattr(hook, "__module__", None) or "").startswith("deepspeed.")
        and hasattr(attn, "ds_id")
        and not getattr(attn, "_z3_leaf", False)
        and next(attn.parameters(recurse=False), None) is None
    )


def foreign_attention_hooks(attn) -> bool:
    """Whether something other than transformers' output capturing or an idle ZeRO-3 hook hooks `attn` (its
    hooks run, once per chunk: one that may swap weights sends the layer to the autograd fallback)."""
    hooks = [*attn._forward_pre_hooks.values(), *attn._forward_hooks.values()]
    foreign = [
        hook
        for hook in hooks
        if getattr(hook, "__name__", "") != "output_capturing_hook" and not _is_idle_zero3_hook(attn, hook)
    ]
    return bool(foreign or attn._backward_hooks or attn._backward_pre_hooks or "forward" in attn.__dict__)


@contextlib.contextmanager
def noting_uncalled_parameters(layer, found: set):
    """While active, which modules run; on leaving, the ids of the parameters of `layer`'s module-list and module-dict
    entries that never ran go into `found`. They get no gradient from this call, as in upstream's step: a LoRA
    layer's adapters where upstream reads the base layer's weight without calling it (Jamba's `dt_proj`), Zamba2's
    other hybrid layers' adapters in its shared block. The streamed Functions refuse a missing gradient of any other
    parameter (one of a module whose weight is read without calling it, as a mixer's `conv1d`, included)."""
    called = set()
    handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda module, args: called.add(module))
    try:
        yield
    finally:
        handle.remove()
    found.update(
        id(param) for container in layer.modules() if isinstance(container, (torch.nn.ModuleList, torch.nn.ModuleDict))
        for entry in container.children() if entry not in called for param in entry.parameters()
    )


def fp32_sums(layer, params) -> list:
    """Per parameter of `params` (the layer's that take a gradient), whether the streamed backward sums its
    half-precision gradient over the chunks in fp32 (mst_core/grads.py `summed_as_computed`): all but a MoE block's
    stacked expert weights (a module named `experts`, its 3-D parameters [experts, out, in]), summed in their own dtype
    as the mini-sequence MoE block sums them (mini_sequence/moe.py). Their fp32 sum would hold twice their bf16 bytes
    while the layer's backward runs: 10.5 GiB per MoE layer for Jamba-Mini's 2.8B expert weights, 5.3 GiB in bf16."""
    experts = {id(param) for name, module in layer.named_modules() if name.rpartition(".")[2] == "experts"
               for param in module.parameters() if param.dim() == 3}
    return [id(param) not in experts for param in params]


def parameter_grads(acc, wanted, layer, uncalled: set):
    """The summed gradients `acc` of the parameters `wanted`, each in its parameter's dtype (None where it got none),
    after raising for any that got none though its module ran (`uncalled`: noting_uncalled_parameters)."""
    for total, param in zip(acc, wanted):
        if total is None and id(param) not in uncalled:
            raise RuntimeError(
                f"streaming backward: a parameter of shape {tuple(param.shape)} that requires grad got no gradient "
                f"from {type(layer).__name__}'s recomputation; refusing to return a missing gradient."
            )
    return iter(None if total is None else total.to(param.dtype) for total, param in zip(acc, wanted))

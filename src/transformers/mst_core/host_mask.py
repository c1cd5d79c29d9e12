"""Under torch.compile, the attention mask decided on the host, as the eager step decides it.

Eagerly, upstream's mask functions (`masking_utils.create_causal_mask` and its sliding-window and chunked kin) read
the inputs on the host: with no padding and no packed sequences (position ids restarting) they return no mask, and
SDPA runs its causal kernel. While dynamo traces they cannot read them, so a compiled step builds the [batch, 1, S, S]
mask, holds it for every layer's backward and hands SDPA a dense mask: at 16K tokens it was most of a compiled
`mini_sequence+checkpointing` step's memory (docs/limits.md). A field of ours exists to make long sequences fit, so
with one set, a compiled step does not build it in the graph:

- the mask function returns a `HostMask`: the inputs it would have read (the 2-D padding mask, the position ids) and
  its own name (patch 0016 wraps the three with `decided_on_host`);
- upstream's SDPA attention function hands a `HostMask` to `host_mask_attention` (patch 0016): one custom operator
  of the graph (`transformers_mst::host_mask_attention_<release>`) whose kernel calls the same mask function eagerly
  on the real inputs, then upstream's `sdpa_attention_forward` with what it returned (no mask, or the mask the eager
  step would have built), with graph; it keeps that graph under a token, its second output, for its backward operator
  (one `autograd.grad`). The compiled graph saves the token, the query, key, value and output for that backward: the
  kept graph reads their memory, which inductor must neither free nor reuse before. A token the graph does not save (a
  checkpointed layer's first forward: the layer is recomputed for its backward, and the recompute's call is the one
  backpropagated) is freed at once, with its graph;
- a streamed layer's operator (streaming_backward/compiled.py) takes a `HostMask` the same way: its kernels build the
  mask on the host before the streamed forward and again before the streamed backward; so does a streamed layer's
  eager call (streaming_backward/layer.py).

Where a call cannot cross (an attention module without a key, dropout in the attention, a tensor argument that
requires grad), the mask is built in the graph as upstream builds it under compile (`HostMask.built`).
"""

import ast
import dataclasses
import functools
import itertools
import weakref

import torch

from .custom_ops import (
    autocast_entry,
    autocast_text,
    autograd_in_kernel,
    can_run_eager_kernels,
    kernel_autocast_state,
    module_key,
    name_modules,
    named_module,
    op_name,
)
from .fields import MINI_SEQUENCE_FIELD, STREAMING_FIELD
from . import recompute_fusion  # noqa: F401  (its construction hook: a checkpointed layer's recompute under compile)
from .model_checks import CONSTRUCTION_HOOKS, text_config
from .replay import restore_autocast_state


@dataclasses.dataclass(frozen=True)
class HostMask:
    """What a mask function would have read on the host; `built` calls it."""

    function: str  # its name in masking_utils
    attention_mask: torch.Tensor | None  # the 2-D padding mask
    position_ids: torch.Tensor | None  # None where the traced call had a cache (upstream then ignores packing)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.attention_mask, self.position_ids) if t is not None]

    def text(self) -> str:
        """This mask as text an operator can take, with its `tensors()` beside it (`from_text` reads it back)."""
        return f"{self.function},{int(self.attention_mask is not None)},{int(self.position_ids is not None)}"

    @classmethod
    def from_text(cls, text: str, tensors) -> "HostMask":
        function, has_mask, has_positions = text.split(",")
        tensors = iter(tensors)
        return cls(function, next(tensors) if has_mask == "1" else None, next(tensors) if has_positions == "1" else None)

    def built(self, config, like: torch.Tensor):
        """The mask function's result for inputs shaped as `like` [batch, S, ...]: no mask where the inputs allow
        SDPA's causal kernel (eagerly), else the mask (eagerly or in a traced graph, as upstream builds it)."""
        function = _UPSTREAM[self.function]
        embeds = like.new_empty(like.shape[0], like.shape[1], 0)  # the functions read its batch, length, dtype, device
        return function(config, embeds, self.attention_mask, None, position_ids=self.position_ids)


def built_masks(config, kwargs: dict, like: torch.Tensor) -> dict:
    """`kwargs` with each `HostMask` built on the host for inputs shaped as `like` [batch, S, ...] (a streamed layer's
    operator: streaming_backward/compiled.py)."""
    return {name: value.built(config, like) if isinstance(value, HostMask) else value for name, value in kwargs.items()}


def name_attention_modules(model) -> None:
    """At model construction, with a field set: keys for the attention modules (upstream's, which call the attention
    interface with `self`), which `host_mask_attention`'s operator takes."""
    config = text_config(model.config)
    if _field_set(config):
        name_modules(m for m in model.modules() if hasattr(m, "is_causal") and hasattr(m, "config"))


def _field_set(config) -> bool:
    return any(getattr(config, field, None) is not None for field in (MINI_SEQUENCE_FIELD, STREAMING_FIELD))


_UPSTREAM = {}  # name -> upstream's mask function, as `decided_on_host` received it


def decided_on_host(create_mask):
    """Wrap one of upstream's mask functions (patch 0016): while dynamo traces a training step of a model with a field
    of ours set and SDPA attention, return a `HostMask` instead of building the mask in the graph. Anything else
    (eager calls, a mask function of the caller's own, a cache that holds tokens, a 4-D mask) calls it as it is. Its
    parameters are upstream's (tests/test_compile.py checks them against the wrapped function's)."""

    def create_or_defer(
        config, inputs_embeds, attention_mask, cache, position_ids=None, or_mask_function=None,
        and_mask_function=None, block_sequence_ids=None, layer_idx=None, allow_is_causal_skip=True,
    ):
        if (
            torch.compiler.is_compiling()
            and _field_set(config)
            and config._attn_implementation == "sdpa"
            and or_mask_function is None
            and and_mask_function is None
            and block_sequence_ids is None
            and allow_is_causal_skip
            and (attention_mask is None or (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2))
            and _empty(cache)
        ):
            return HostMask(create_mask.__name__, attention_mask, position_ids if cache is None else None)
        return create_mask(
            config, inputs_embeds, attention_mask, cache, position_ids=position_ids,
            or_mask_function=or_mask_function, and_mask_function=and_mask_function,
            block_sequence_ids=block_sequence_ids, layer_idx=layer_idx, allow_is_causal_skip=allow_is_causal_skip,
        )

    _UPSTREAM[create_mask.__name__] = create_mask
    return functools.wraps(create_mask)(create_or_defer)


def _empty(cache) -> bool:
    """Whether the traced call's cache holds nothing (the model's own, made by the default `use_cache=True`): the mask
    is then the one it would be without a cache, except that upstream ignores packed sequences there."""
    from ..cache_utils import DynamicCache

    return cache is None or (type(cache) is DynamicCache and cache.get_seq_length() == 0)


def host_mask_attention(module, query, key, value, attention_mask: HostMask, dropout=0.0, scaling=None, is_causal=None,
                        **kwargs):
    """Upstream's SDPA attention given a `HostMask` (patch 0016): one operator of the compiled graph, or where the call
    cannot cross, upstream's call with the mask built in the graph (or, called eagerly after a graph break, on the
    host: as upstream's eager step builds it)."""
    from ..integrations.sdpa_attention import sdpa_attention_forward

    key_of_module = module_key(module)
    constants = {name: v for name, v in kwargs.items() if not isinstance(v, torch.Tensor)}
    tensors = {name: v for name, v in kwargs.items() if isinstance(v, torch.Tensor)}
    if (
        not torch.compiler.is_compiling()
        or key_of_module is None
        or dropout != 0.0
        or not can_run_eager_kernels()
        or any(t.requires_grad for t in tensors.values())  # (a position bias that learns: the operator gives it none)
        or not all(v is None or isinstance(v, (bool, int, float, str)) for v in constants.values())
        or not all(v is None or isinstance(v, (bool, int, float)) for v in (scaling, is_causal))
    ):
        mask = attention_mask.built(module.config, query.transpose(1, 2))
        return sdpa_attention_forward(module, query, key, value, mask, dropout, scaling, is_causal, **kwargs)
    # The output's dtype, which the graph needs before the kernel runs (autocast casts SDPA's inputs): upstream's call
    # on the first query while tracing, dead code that inductor drops.
    first = sdpa_attention_forward(module, query[:, :, :1], key, value, None, 0.0, scaling, False, **kwargs)[0]
    text = repr((
        attention_mask.text(), list(tensors), scaling, is_causal, sorted(constants.items()),
        autocast_text(query.device.type), str(first.dtype).removeprefix("torch."),
    ))
    out, _ = host_mask_sdpa(query, key, value, [*attention_mask.tensors(), *tensors.values()], key_of_module, text)
    return out, None


def _decoded(text):
    """(the mask's text, the other tensors' names, scaling, is_causal, the constants, the autocast contexts
    [(device type, dtype)], the output's dtype), as `host_mask_attention` wrote them."""
    mask_text, names, scaling, is_causal, constants, autocast, out_dtype = ast.literal_eval(text)
    autocast = [autocast_entry(part.split("=", 1)[1]) for part in filter(None, autocast.split(";"))]
    return mask_text, names, scaling, is_causal, dict(constants), autocast, getattr(torch, out_dtype)


def _call(query, key, value, tensors, key_of_module, text):
    """Upstream's SDPA attention function on these inputs, with the mask built on the host."""
    from ..integrations.sdpa_attention import sdpa_attention_forward

    mask_text, names, scaling, is_causal, constants, _, _ = _decoded(text)
    module = named_module(key_of_module)
    kwargs = dict(zip(names, tensors[len(tensors) - len(names) :]), **constants)
    mask = HostMask.from_text(mask_text, tensors).built(module.config, query.transpose(1, 2))
    return sdpa_attention_forward(module, query, key, value, mask, 0.0, scaling, is_causal, **kwargs)[0]


_TOKENS = itertools.count()
_PENDING = {}  # token -> (query, key, value leaves, output) of a forward whose backward has not run yet


@torch.library.custom_op(op_name("host_mask_attention"), mutates_args=())
def host_mask_sdpa(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, tensors: list[torch.Tensor], key_of_module: int,
    text: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(upstream's attention output, a token naming this call's graph for its backward). The kernel keeps the call's
    autograd graph (what SDPA saves, as the eager step keeps it) under the token, a second output that the compiled
    graph saves for the backward. A token the graph does not save (a checkpointed layer's first forward, whose
    backward recomputes the layer: the recompute's own call takes the backward) is freed at once, and the graph with
    it (`weakref.finalize`)."""
    leaves = [t.detach().requires_grad_() for t in (query, key, value)]
    autocast_state = kernel_autocast_state(_decoded(text)[5], query.device.type)
    with autograd_in_kernel(), restore_autocast_state(autocast_state), torch.enable_grad():
        out = _call(*leaves, tensors, key_of_module, text)
    if out.dtype != _decoded(text)[6]:
        raise RuntimeError(
            f"transformers-mst under torch.compile: the attention returned {out.dtype}, the traced graph expected "
            f"{_decoded(text)[6]}; train without torch.compile, and please report this with your model."
        )
    number = next(_TOKENS)
    token = torch.tensor(number, dtype=torch.int64)
    _PENDING[number] = leaves, out
    weakref.finalize(token, _PENDING.pop, number, None)
    return out.detach(), token


@host_mask_sdpa.register_fake
def _(query, key, value, tensors, key_of_module, text):
    # [batch, queries, heads, value width], as upstream's function returns it
    out = query.new_empty(query.shape[0], query.shape[2], query.shape[1], value.shape[-1], dtype=_decoded(text)[6])
    return out, torch.empty((), dtype=torch.int64, device="cpu")


@torch.library.custom_op(op_name("host_mask_attention_backward"), mutates_args=())
def host_mask_sdpa_backward(
    grad: torch.Tensor, token: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> list[torch.Tensor]:
    """The gradients of the query, key and value: the forward's graph, backpropagated once. The graph saves the three
    for this operator, so that inductor keeps their memory (which the kept graph reads) until it runs."""
    pending = _PENDING.pop(int(token), None)
    if pending is None:
        raise RuntimeError(
            "transformers-mst: the compiled attention's graph was already backpropagated (a second backward through "
            "one compiled step, retain_graph=True, is not supported with a field of ours set) or never kept."
        )
    leaves, out = pending
    # The recorded graph's backward, with autocast off (its casts are recorded)
    with autograd_in_kernel(), restore_autocast_state(kernel_autocast_state([], query.device.type)):
        grads = torch.autograd.grad(out, leaves, grad)
    # In the layout of the inputs, as the fake says (a copy only where they differ: the repeated keys' gradients)
    return [g if g.stride() == t.stride() else torch.empty_like(t).copy_(g) for g, t in zip(grads, (query, key, value))]


@host_mask_sdpa_backward.register_fake
def _(grad, token, query, key, value):
    return [torch.empty_like(t) for t in (query, key, value)]


def _setup_context(ctx, inputs, output):
    query, key, value, tensors, key_of_module, text = inputs
    ctx.count = len(tensors)
    ctx.mark_non_differentiable(output[1])
    # The graph kept under the token reads the inputs' memory and may read the output's (SDPA saves its output, which
    # the returned tensor can be): saved here, inductor neither frees nor reuses them before the backward operator.
    ctx.save_for_backward(output[1], query, key, value, output[0])


def _backward(ctx, grad, grad_token):
    grads = host_mask_sdpa_backward(grad, *ctx.saved_tensors[:4])
    return grads[0], grads[1], grads[2], [None] * ctx.count, None, None


host_mask_sdpa.register_autograd(_backward, setup_context=_setup_context)
CONSTRUCTION_HOOKS.append(name_attention_modules)

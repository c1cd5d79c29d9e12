"""A streamed layer call as one operator of a compiled graph: `torch.compile` traces the model around it without a
graph break (`fullgraph=True` trains).

Dynamo cannot trace the streamed layer itself: its forward inspects the mask on the host and stops the layer at the
cache by raising, its backward takes `torch.autograd.grad` of each recomputed chunk. So the layer's call is a
`torch.library` custom operator (`transformers_mst::streamed_layer_<release>`, mst_core/custom_ops.py `op_name`),
opaque to the compiler, whose kernel runs the eager streamed forward (layer.py's `StreamedLayerFunction.forward`; for a
layer that streams through its recurrent state, recurrent.py's `StreamedRecurrentFunction.forward`, since mst.39) and
whose registered backward is a second operator (`streamed_layer_backward`) running its backward. The compiled graph
saves the layer input and the tensors of the call (mask, position embeddings) for that backward, as checkpointing
saves the input.

What crosses the operator boundary: the hidden states, the call's other tensors, the layer's trainable parameters,
an integer key naming the layer (`register_layers`, at model construction: a compiled graph cannot hold a module)
and a string with the call's other arguments and the autocast state at trace time (a compiled graph has no autocast
context at run time: the kernel enters it). Each forward leaves its host-side state (chunk plan, RNG states) for
its backward under a token, a second (integer) output that the graph saves for that backward: two calls of one
layer before their backward (two losses summed, say) keep their own states.

A custom operator's kernel runs below autograd and autocast (their dispatch keys are excluded while it runs): the
forward kernel re-enables autocast where the traced call was under it, the backward kernel autograd (its
`torch.autograd.grad` calls; the streamed backward restores the forward's autocast state itself), by torch's
dispatch-key guard (`torch._C._ForceDispatchKeyGuard`).

MoE router logits (`output_router_logits=True`, router.py) are the operator's second output: [batch * S, experts] as
the eager streamed layer returns them, appended to the model's collector in the traced graph. Their shape and dtype
must be known while tracing (the operator's fake): the experts are the rows of the recording router's weight, the
dtype the hidden states' or autocast's; the kernel checks both.

Only where the whole call can cross: a registered layer (not a deep copy of one), plain parameters (no FSDP/ZeRO-3
views), no input offload, no outputs recorded inside the layer but router logits of one router with a 2-D weight,
arguments (positional ones by name) that are tensors, tuples of tensors, constants or an argument each chunk gets a
fresh, empty one of (`layer.FRESH_PER_CHUNK`: Gemma-4's `KVSharingDict`); a tensor that requires grad only where it is
rows of the sequence (a row input of the streamed Functions: Gemma-4's per-layer input, Zamba2's embeddings, also
passed to its Mamba2 layers, since mst.41; the backward operator returns its gradient, zeros where the layer never read
it); otherwise the call runs eagerly as before (one graph
break: `layer.decoder_layer_forward`). The parameters of modules the call never ran
get zeros from the operator's backward (the eager Functions give them none, as upstream does: an operator returns a
tensor for each parameter the graph traced).
"""

import ast
import functools
import importlib
import itertools

import torch

from ..mst_core.custom_ops import (
    autocast_entry,
    autocast_in_kernel,
    autocast_text,
    autograd_in_kernel,
    can_run_eager_kernels,
    module_key,
    name_modules,
    named_module,
    op_name,
)
from ..mst_core.fields import STREAMING_FIELD
from ..mst_core.host_mask import HostMask, built_masks
from ..mst_core.wrappers import is_plain_parameter
from . import router
from .layer import FRESH_PER_CHUNK, StreamedCall
from .offload import offload_requested
from .parts import layer_config, returned


_TOKENS = itertools.count()
_PENDING = {}  # token -> the state of a forward whose backward has not run yet


def register_layers(model) -> None:
    """Give each decoder layer of `model` a key the compiled operator can name it by (at model construction, when
    `streaming_backward_chunk` is set: streaming_backward/__init__.py, via mst_core/model_checks.py)."""
    from ..modeling_layers import GradientCheckpointingLayer

    name_modules(
        module for module in model.modules()
        if isinstance(module, GradientCheckpointingLayer) and _class_forward(module) is not None
    )


def _class_forward(layer):
    """The layer class's forward as upstream's wrapper received it (modeling_layers: `wraps(forward)`)."""
    return getattr(type(layer).forward, "__wrapped__", None)


def _encode(kwargs, device_type, router_logits=None):
    """(tensors, text): the call's keyword arguments as a list of tensors and a text for the rest, or None where one
    cannot cross the operator boundary. `router_logits`: (experts, dtype) of the router logits the call records."""
    tensors, parts = [], []
    if router_logits is not None:
        experts, dtype = router_logits
        parts.append(f"@router_logits={experts},{str(dtype).removeprefix('torch.')}")
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            # "r": a row input of the layer that requires grad (layer.py `StreamedCall.row_inputs`): differentiated
            parts.append(f"{name}={'r' if value.requires_grad else 't'}{len(tensors)}")
            tensors.append(value)
        elif name in FRESH_PER_CHUNK and value is not None:
            # Each chunk gets an empty one of its type anyway (layer.py): the kernel makes one.
            parts.append(f"{name}=n{type(value).__module__}:{type(value).__qualname__}")
        elif isinstance(value, tuple) and value and all(isinstance(v, torch.Tensor) for v in value):
            parts.append(f"{name}=u{len(tensors)},{len(value)}")
            tensors.extend(value)
        elif isinstance(value, HostMask):  # the mask, decided by the kernels on the host (mst_core/host_mask.py)
            parts.append(f"{name}=h{len(tensors)}:{value.text()}")
            tensors.extend(value.tensors())
        elif value is None or isinstance(value, (bool, int, float)) or (isinstance(value, str) and ";" not in value):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                # A number dynamo made dynamic (a layer index a resumed frame reads): specialized, as the text needs.
                value = int(value) if isinstance(value, int) else float(value)
            parts.append(f"{name}=c{value!r}")
        else:
            return None
    autocast = autocast_text(device_type)
    return tensors, ";".join(parts + ([autocast] if autocast else []))


def _decode(text, tensors):
    """The keyword arguments, the autocast states [(device type, dtype)] and the router logits' (experts, dtype) or
    None, that `_encode` wrote. The row inputs that require grad come as leaves that require grad (the kernels run
    without graph: `StreamedCall` takes them as row inputs by that flag)."""
    kwargs, autocast, router_logits = {}, [], None
    for part in filter(None, text.split(";")):
        name, spec = part.split("=", 1)
        if name == "@router_logits":
            experts, dtype = spec.split(",")
            router_logits = int(experts), getattr(torch, dtype)
        elif name == "@autocast":
            autocast.append(autocast_entry(spec))
        elif spec[0] == "t":
            kwargs[name] = tensors[int(spec[1:])]
        elif spec[0] == "r":
            kwargs[name] = tensors[int(spec[1:])].detach().requires_grad_()
        elif spec[0] == "n":
            module, qualname = spec[1:].split(":")
            kwargs[name] = functools.reduce(getattr, qualname.split("."), importlib.import_module(module))()
        elif spec[0] == "u":
            first, count = map(int, spec[1:].split(","))
            kwargs[name] = tuple(tensors[first : first + count])
        elif spec[0] == "h":
            first, mask_text = spec[1:].split(":", 1)
            kwargs[name] = HostMask.from_text(mask_text, tensors[int(first) :])
        else:
            kwargs[name] = ast.literal_eval(spec[1:])
    return kwargs, autocast, router_logits


def _row_positions(text):
    """The positions in the operator's `tensors` of the row inputs that require grad (`_encode`'s "r")."""
    return [int(spec[1:]) for name, spec in (part.split("=", 1) for part in filter(None, text.split(";")))
            if not name.startswith("@") and spec[0] == "r"]


class _State:
    """What the streamed Function keeps on its ctx between forward and backward."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


def _router_logits_like(hidden, router_logits):
    """The router logits' tensor as the fake gives it: [batch * S, experts] (empty [0] where none are recorded)."""
    if router_logits is None:
        return hidden.new_empty(0)
    experts, dtype = router_logits
    return hidden.new_empty(hidden.shape[0] * hidden.shape[1], experts, dtype=dtype)


# The operators' names carry the release (`op_name`): torch.compile's on-disk caches call operators by name, so a
# graph compiled by another release, against another schema or autograd formula, must not find these.
@torch.library.custom_op(
    op_name("streamed_layer"), mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,)
)
def streamed_layer(
    hidden: torch.Tensor, tensors: list[torch.Tensor], params: list[torch.Tensor], key: int, text: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the layer's output, its router logits or an empty tensor, a token naming this call's state for its
    backward)."""
    layer = named_module(key)
    kwargs, autocast, router_logits = _decode(text, tensors)
    kwargs = built_masks(layer_config(layer), kwargs, hidden)
    with autocast_in_kernel(autocast):
        streamed, function = _prepared_call(layer, hidden, kwargs)
        # The kernel runs outside the model's forward as upstream's collector sees it: told by the traced call.
        streamed.records_router_logits = router_logits is not None
        rows = streamed.row_inputs
        if list(rows) != [name for name, value in kwargs.items() if isinstance(value, torch.Tensor) and value.requires_grad]:
            raise RuntimeError(
                f"{STREAMING_FIELD} under torch.compile: {type(layer).__name__}'s call took other row inputs than the "
                "traced graph differentiates; please report this with your model."
            )
        state = _State()
        state.call, state.function, state.layer = streamed, function, layer
        state.needs_input_grad = (True, False, False) + (True,) * (len(rows) + len(params))
        with torch.no_grad():
            out = function.forward(state, hidden, streamed, None, *rows.values(), *params)
    logits = _router_logits_like(hidden, router_logits)
    if router_logits is not None:
        out, recorded = out
        if recorded.shape != logits.shape or recorded.dtype != logits.dtype:
            raise RuntimeError(
                f"{STREAMING_FIELD} under torch.compile: {type(layer).__name__}'s router recorded logits of shape "
                f"{tuple(recorded.shape)} and dtype {recorded.dtype}, the traced graph expected "
                f"{tuple(logits.shape)} and {logits.dtype}; train without output_router_logits or without compile, "
                "and please report this with your model."
            )
        logits = recorded
    # The tensors come back with the backward (saved by the compiled graph): keep only host-side state here.
    state.saved_tensors, state.params = None, None
    state.argument_names = list(streamed.arguments)  # the call's arguments the chunks get (flash ones taken out)
    streamed.arguments = {}
    streamed.row_inputs = dict.fromkeys(streamed.row_inputs)
    if isinstance(streamed, StreamedCall):  # an attention layer's call holds its mask (a recurrent one has none)
        streamed.mask = None
    token = next(_TOKENS)
    _PENDING[token] = state
    return out, logits, torch.tensor(token, dtype=torch.int64)


@streamed_layer.register_fake
def _(hidden, tensors, params, key, text):
    router_logits = _decode(text, tensors)[2]
    token = torch.empty((), dtype=torch.int64, device="cpu")
    return torch.empty_like(hidden), _router_logits_like(hidden, router_logits), token


@torch.library.custom_op(op_name("streamed_layer_backward"), mutates_args=())
def streamed_layer_backward(
    grad: torch.Tensor, grad_router_logits: torch.Tensor, token: torch.Tensor, hidden: torch.Tensor,
    tensors: list[torch.Tensor], params: list[torch.Tensor], text: str,
) -> list[torch.Tensor]:
    state = _PENDING.pop(int(token))
    kwargs, _, router_logits = _decode(text, tensors)
    kwargs = built_masks(layer_config(state.layer), kwargs, hidden)
    streamed = state.call
    if isinstance(streamed, StreamedCall):
        streamed.mask = kwargs.pop(streamed.mask_name, None)
    streamed.arguments = {name: kwargs[name] for name in state.argument_names}
    rows = streamed.row_inputs
    streamed.row_inputs = {name: kwargs[name] for name in rows}
    state.saved_tensors, state.params = (hidden,), tuple(params)
    with autograd_in_kernel():
        grads = state.function.backward(state, grad, grad_router_logits if router_logits is not None else None)
    # (the input's, None, None, the row inputs', the parameters'). The eager Functions give no gradient to the
    # parameters of module-list entries the call never ran, as upstream's step gives them none
    # (wrappers.noting_uncalled_parameters: a LoRA adapter on Mamba's `dt_proj`, whose weight the mixer reads without
    # calling it); any other missing one raised above. An operator returns a tensor for each parameter the graph
    # traced: zeros for those (docs/limits.md).
    # A row input the layer never read (Zamba2's Mamba2 layers are passed the embeddings) gets zeros, as such a parameter.
    row_grads, param_grads = grads[3 : 3 + len(rows)], grads[3 + len(rows) :]
    return [
        grads[0],
        *(torch.zeros_like(row) if g is None else g for g, row in zip(row_grads, streamed.row_inputs.values())),
        *(torch.zeros_like(p) if g is None else g for g, p in zip(param_grads, params)),
    ]


@streamed_layer_backward.register_fake
def _(grad, grad_router_logits, token, hidden, tensors, params, text):
    rows = [torch.empty_like(tensors[i]) for i in _row_positions(text)]
    return [torch.empty_like(hidden), *rows, *(torch.empty_like(p) for p in params)]


def _setup_context(ctx, inputs, output):
    hidden, tensors, params, key, text = inputs
    ctx.text, ctx.count, ctx.rows = text, len(tensors), _row_positions(text)
    ctx.mark_non_differentiable(output[2])
    ctx.save_for_backward(output[2], hidden, *tensors, *params)


def _backward(ctx, grad, grad_router_logits, grad_token):
    token, hidden, *rest = ctx.saved_tensors
    tensors, params = rest[: ctx.count], rest[ctx.count :]
    grads = streamed_layer_backward(grad, grad_router_logits, token, hidden, tensors, params, ctx.text)
    tensor_grads = [None] * ctx.count
    for position, row_grad in zip(ctx.rows, grads[1 : 1 + len(ctx.rows)]):
        tensor_grads[position] = row_grad
    return grads[0], tensor_grads, list(grads[1 + len(ctx.rows) :]), None, None


streamed_layer.register_autograd(_backward, setup_context=_setup_context)


def _prepared_call(layer, hidden, kwargs):
    """(the streamed call, the autograd Function whose forward and backward the kernels run) for `layer`: a recurrent
    layer's `RecurrentCall` (recurrent.py) or an attention layer's `StreamedCall` (layer.py)."""
    from . import recurrent
    from .layer import (
        StreamedLayerFunction,
        prepared_call,
        prepared_recurrent_call,
        skip_and_record_projections,
        streams_through_states,
    )

    if streams_through_states(layer):
        call, _ = prepared_recurrent_call(_class_forward(layer), layer, (hidden,), kwargs)
        return call, recurrent.StreamedRecurrentFunction
    streamed, _ = prepared_call(_class_forward(layer), layer, (hidden,), kwargs)
    skip_and_record_projections(streamed, layer)
    return streamed, StreamedLayerFunction


def traced_call(layer, args, kwargs):
    """While dynamo traces: the streamed layer's output as one `streamed_layer` operator in the graph, or None where
    the call cannot cross (see the module's docstring; the caller then runs it eagerly)."""
    from .layer import _bound_arguments, check_given_cache

    key = module_key(layer)  # None for a copy of a registered layer (copy.deepcopy copies its key)
    if key is None or offload_requested(layer) or not can_run_eager_kernels():
        return None
    kwargs, _, cache = _bound_arguments(_class_forward(layer), layer, args, kwargs)  # positional ones by name
    hidden = kwargs.pop("hidden_states")
    if not isinstance(hidden, torch.Tensor):
        return None
    # A streamed call neither reads nor fills the cache (the model's, made by the default `use_cache=True`): refused
    # where it holds something, as eagerly; it does not cross.
    check_given_cache(layer, cache)
    collector = router.model_collector()
    if collector and set(collector) - set(router.HANDLED_OUTPUTS):
        return None  # outputs recorded inside the layer (attentions): the eager call refuses them (checks.py)
    router_logits = None
    if router.recording(collector):
        experts = router.experts_recorded(key)
        if experts is None:
            return None
        if experts:
            device_type = hidden.device.type
            dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype
            router_logits = experts, dtype
    params = [p for p in layer.parameters() if p.requires_grad]
    # Nothing to differentiate: the eager call runs without graph (no backward would take the operator's state).
    if not (hidden.requires_grad or params) or not all(is_plain_parameter(p) for p in params):
        return None
    encoded = _encode(kwargs, hidden.device.type, router_logits)
    if encoded is None:
        return None
    tensors, text = encoded
    # Another tensor that requires grad crosses as a row input (Gemma-4's per-layer input, Zamba2's embeddings), whose
    # gradient the operator returns, where the streamed Functions take it: rows of the sequence. Else the call runs
    # eagerly (the operator would drop its gradient).
    grad_inputs = [value for value in kwargs.values() if isinstance(value, torch.Tensor) and value.requires_grad]
    if any(isinstance(value, tuple) and any(v.requires_grad for v in value) for value in kwargs.values()):
        return None
    if not all(value.dim() >= 2 and value.shape[:2] == hidden.shape[:2] for value in grad_inputs):
        return None
    out, logits, _ = streamed_layer(hidden, tensors, params, key, text)
    out = router.hand_over((out, logits) if router_logits is not None else out)
    return returned(layer, out)

"""Sparse MoE blocks (Mixtral, Qwen3-MoE, GPT-OSS, Llama-4, ...) by mini-sequences of tokens.

Routing is token-wise (each token's top-k experts and weights depend on that token only), so running the block's
own upstream `forward` on chunks of the sequence gives the same output and gradients. The chunks run through the
MLP's Function (mlp.py): only the block's input is kept for backward, and each chunk's routing and expert
intermediates are rebuilt in backward one chunk at a time. So under activation checkpointing each token goes through
the experts twice a step, as without the flag (the layer's recompute stops before the block, see `SavedInput` in mst_core/wrappers.py).
Where a wrapper or hook may swap the weights (mst_core/wrappers.py), each chunk runs under non-reentrant checkpointing instead
and every gradient flows through ordinary autograd.

The router logits: in 5.24 `output_router_logits=True` collects them with a forward hook on the router module
(`_can_record_outputs = {"router_logits": OutputRecorder(...TopKRouter, index=0)}`, utils/output_capturing.py),
which appends the hooked output to the collector of the running forward. Called per chunk, that hook would append
one entry per chunk, flattened chunk by chunk, and `load_balancing_loss_func` (which concatenates the entries and
lays an attention mask over them in (batch, position) order) would pair logits with the wrong mask entries. So
each chunk's call sets a collector of its own and returns its router logits as one more output, and the block
appends to the model's collector once: the logits of the whole sequence in upstream's (batch, position) order, the
tensor the unsplit block would have recorded, with their graph (the auxiliary loss's gradient reaches the router
through the Function's backward, which rebuilds each chunk's logits with the same collector).
"""


import functools

import torch

from ..utils import output_capturing
from .compiled import traced_chunks
from .mlp import _as_outputs, _forward_chunks, chunked_function, module_forward
from ..mst_core.router_logits import ROUTER_LOGITS, is_output_capturing_hook, own_router_collector, token_major
from ..mst_core.wrappers import checkpointed_chunks, function_parameters


# Under torch.compile the chunks run as checkpoint regions (mst_core/wrappers.py `checkpointed_chunks`), inside which
# dynamo refuses a mutation of state from outside ("HOP: Unsafe side effect"): setting the collector is one, and
# dynamo then skips the whole frame. This torch helper marks the call's side effects as intended: dynamo replays them
# once after the forward graph, and the compiled backward's recompute runs no Python (the rebuilt chunk's logits
# were only ever collected to be dropped). Eagerly it just calls the function.
_side_effects_allowed = getattr(
    torch._dynamo.utils, "_disable_side_effect_safety_checks_for_current_subtracer", lambda fn, *args: fn(*args)
)


def _records_router_logits(hook) -> bool:
    """Upstream's router-logits recorder: it only appends to the collector `_chunk_forward` sets, so it does not stop
    the Function path."""
    return is_output_capturing_hook(hook, ROUTER_LOGITS)


def _merged_outputs(chunks: list, batch_shape: torch.Size) -> tuple:
    """The chunks' outputs put together: the hidden states [..., S, d] along the sequence, any further per-token
    outputs (GPT-OSS's router scores [tokens, top_k], the router logits) whole, in (batch, position) order."""
    first, *rest = zip(*(_as_outputs(chunk) for chunk in chunks))
    return (torch.cat(first, dim=-2), *(token_major(list(parts), batch_shape) for parts in rest))


def _chunk_forward(recording: bool, tokens_flattened: bool, block, chunk: torch.Tensor, beside=None):
    """The block's own forward on one chunk; while the model records router logits, with this chunk's logits as one
    more output (the router's hook appends them to the collector set here, in forward and in the rebuild alike).
    A block that flattens its output (`tokens_flattened`) has it laid out as the chunk here, [..., C, d], as the
    chunked paths join the first output along the sequence. `beside`: an MLP whose output on the same chunk is added
    to the block's (`mini_sequence_moe`)."""
    chunk = chunk.contiguous()  # the blocks flatten their input with `.view(-1, hidden)`, which a slice refuses
    if not recording:
        outputs = module_forward(block, chunk)
    else:
        outputs = _side_effects_allowed(_recorded_chunk_forward, block, chunk)
    if beside is not None:
        first, *rest = _as_outputs(outputs)
        first = first + module_forward(beside, chunk)
        outputs = (first, *rest) if rest else first
    if not tokens_flattened:
        return outputs
    first, *rest = _as_outputs(outputs)
    first = first.view(*chunk.shape[:-1], first.shape[-1])  # [batch * C, d] in (batch, position) order
    return (first, *rest) if rest else first


def _recorded_chunk_forward(block, chunk):
    with own_router_collector() as collected:
        outputs = _as_outputs(module_forward(block, chunk))
    logits = collected[ROUTER_LOGITS]
    if len(logits) != 1:
        raise RuntimeError(
            f"mini-sequence {type(block).__name__}: expected one router output per chunk, the router's hooks recorded "
            f"{len(logits)}; unset mini_sequence_chunk for this model."
        )
    return (*outputs, logits[0])


def mini_sequence_moe(block, hidden_states: torch.Tensor, chunk_size: int, tokens_flattened: bool = False,
                      beside=None):
    """`block(hidden_states)` [..., S, d] one mini-sequence of `chunk_size` tokens at a time, with the router
    logits recorded once, whole (see the module docstring). With `tokens_flattened`, the output is [batch * S, d],
    as the block returns it. `beside`: an MLP on the same input whose output is added to the block's (Granite's shared
    MLP), run in the same chunks: one saved input for both, so a layer's recompute stops before either (`SavedInput`
    in mst_core/wrappers.py), where two Functions would save it twice, the second after the block ran."""
    collector = output_capturing._active_collector.get()
    recording = collector is not None and ROUTER_LOGITS in collector
    forward_fn = functools.partial(_chunk_forward, recording, tokens_flattened, beside=beside)
    params = function_parameters(block, harmless_hook=_records_router_logits)
    if beside is not None and params is not None:
        beside_params = function_parameters(beside)
        params = None if beside_params is None else params + beside_params
    modules, kind = (block,) if beside is None else (block, beside), "moe_flattened" if tokens_flattened else "moe"
    if not recording and (traced := traced_chunks(kind, modules, hidden_states, chunk_size)) is not None:
        outputs = (traced,)  # under torch.compile: one operator of the graph (compiled.py)
    elif not torch.is_grad_enabled():
        outputs = _as_outputs(_forward_chunks(forward_fn, block, hidden_states, chunk_size))
    elif params is not None:
        # The expert weights' gradients are summed over the chunks in their own dtype, as autograd sums them without
        # the flag: an fp32 sum holds 2x the experts' bf16 bytes while a layer's backward runs (planner, GPT-OSS-20B,
        # 8K tokens, mini_sequence + checkpointing: 2.55 GiB more at the step's peak).
        outputs = _as_outputs(chunked_function(forward_fn, block, hidden_states, chunk_size, params, fp32_sums=False))
    else:
        chunks = checkpointed_chunks(lambda chunk, start, end: forward_fn(block, chunk), hidden_states, chunk_size)
        outputs = _merged_outputs(chunks, hidden_states.shape[:-2])
    if recording:
        collector[ROUTER_LOGITS].append(outputs[-1])
        outputs = outputs[:-1]
    if tokens_flattened:
        outputs = (outputs[0].reshape(-1, outputs[0].shape[-1]), *outputs[1:])
    return outputs[0] if len(outputs) == 1 else outputs

"""Sparse MoE blocks (Mixtral, Qwen3-MoE, GPT-OSS) by mini-sequences of tokens.

Routing is token-wise (each token's top-k experts and weights depend on that token only), so running the block's
own upstream `forward` on chunks of the sequence gives the same output and gradients. Each chunk runs under
non-reentrant activation checkpointing (wrappers.py's `checkpointed_chunks`): only the chunk's input is kept, its
routing and expert intermediates are rebuilt in backward one chunk at a time, and every gradient, the router's
included, flows through ordinary autograd.

The router logits: in 5.24 `output_router_logits=True` collects them with a forward hook on the router module
(`_can_record_outputs = {"router_logits": OutputRecorder(...TopKRouter, index=0)}`, utils/output_capturing.py),
which appends the hooked output to the collector of the running forward. Called per chunk, that hook would append
one entry per chunk, flattened chunk by chunk, and `load_balancing_loss_func` (which concatenates the entries and
lays an attention mask over them in (batch, position) order) would pair logits with the wrong mask entries. So
while the chunks run, the router's hooks append to a collector of ours, and the block appends to the model's
collector once: the chunks' logits (which keep their graph, for the auxiliary loss's gradient) put back in
upstream's (batch, position) order, the tensor the unsplit block would have recorded.
"""

import torch

from ..utils import output_capturing
from .mlp import _chunk_bounds, module_forward
from .wrappers import checkpointed_chunks


ROUTER_LOGITS = "router_logits"


def _token_major(per_chunk: list, batch_shape: torch.Size) -> torch.Tensor:
    """[tokens of the whole sequence, ...] in (batch, position) order, from one [batch * chunk, ...] per chunk (the
    blocks flatten their input to tokens in (batch, position) order, so a chunk's rows are its rows of each batch)."""
    tail = per_chunk[0].shape[1:]
    return torch.cat([t.reshape(*batch_shape, -1, *tail) for t in per_chunk], dim=len(batch_shape)).reshape(-1, *tail)


def _merged_router_logits(per_chunk: list, batch_shape: torch.Size, num_chunks: int) -> torch.Tensor:
    """The router logits of the whole sequence, as the unsplit block's router would have returned them."""
    if len(per_chunk) != num_chunks:
        raise RuntimeError(
            f"mini-sequence MoE block: expected one router output per chunk ({num_chunks}), the router's hooks "
            f"recorded {len(per_chunk)}; unset mini_sequence_chunk for this model."
        )
    return _token_major(per_chunk, batch_shape)


def _merged_outputs(chunks: list, batch_shape: torch.Size):
    """The chunks' outputs put together: the hidden states [..., S, d] along the sequence; a block that also
    returns per-token tensors (GPT-OSS: `(hidden_states, router_scores [tokens, top_k])`) gets those back whole,
    in (batch, position) order."""
    if isinstance(chunks[0], torch.Tensor):
        return torch.cat(chunks, dim=-2)
    first, *rest = zip(*chunks)
    return (torch.cat(first, dim=-2), *(_token_major(list(parts), batch_shape) for parts in rest))


def mini_sequence_moe(block, hidden_states: torch.Tensor, chunk_size: int):
    """`block(hidden_states)` [..., S, d] one mini-sequence of `chunk_size` tokens at a time, with the router
    logits recorded once, whole (see the module docstring)."""
    collector = output_capturing._active_collector.get()
    recording = collector is not None and ROUTER_LOGITS in collector
    if recording:
        token = output_capturing._active_collector.set({ROUTER_LOGITS: []})
    try:
        if torch.is_grad_enabled():
            # contiguous: the blocks flatten their input with `.view(-1, hidden)`, which a slice of a batch refuses
            chunks = checkpointed_chunks(
                lambda chunk, start, end: module_forward(block, chunk.contiguous()), hidden_states, chunk_size
            )
        else:
            chunks = [
                module_forward(block, hidden_states[..., start:end, :].contiguous())
                for start, end in _chunk_bounds(hidden_states.shape[-2], chunk_size)
            ]
        per_chunk = output_capturing._active_collector.get()[ROUTER_LOGITS] if recording else None
    finally:
        if recording:
            output_capturing._active_collector.reset(token)
    batch_shape = hidden_states.shape[:-2]
    if recording:
        collector[ROUTER_LOGITS].append(_merged_router_logits(per_chunk, batch_shape, len(chunks)))
    return _merged_outputs(chunks, batch_shape)

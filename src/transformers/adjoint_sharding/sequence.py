"""One long sequence split in time across processes (the adjoint sharding paper, §4.4-4.5, Algorithm 4).

Rank r of a process group holds tokens [start_r, end_r) of every sequence in the batch and runs
the same model on them. Only two things in a Mamba layer look across a time boundary: the causal
depthwise convolution (its first `conv_kernel - 1` outputs read the previous part's last inputs) and
the scan (its first state continues the previous part's last state). So, per layer:

- forward: each rank sends its last `conv_kernel - 1` conv inputs to the next rank; the scan of rank r
  waits for rank r-1's last state, runs its part from it, and sends its own last state on;
- backward: the gradients of those same tensors go the other way: the adjoint entering rank r's
  part from the right (the gradient of its last state) comes from rank r+1, and rank r sends the
  gradient of its first state (a[start] * adj[start]) and of the borrowed conv inputs to rank r-1.

Each rank keeps only its own part's activations. The scan is a chain over ranks (rank r's scan
starts when rank r-1's ends, per layer, and the reverse in backward), so the time of one step is
about that of one process; what the ranks split is the memory. Parameter gradients are partial
sums per rank: `all_reduce_gradients` adds them up. See docs/adjoint-sharding.md ("Adjoint sharding: one sequence
across processes") for the training loop.
"""

import torch
import torch.distributed as dist

from .integration import enabled


class SequenceLink:
    """The ranks of `group` in order, and this process's place among them."""

    def __init__(self, group=None):
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)

    def _peer(self, offset):
        return dist.get_global_rank(self.group, self.rank + offset)

    @property
    def first(self):
        return self.rank == 0

    @property
    def last(self):
        return self.rank == self.size - 1

    def send(self, tensor, offset):
        dist.send(tensor.contiguous(), self._peer(offset), group=self.group)

    def receive(self, like, offset):
        buffer = torch.empty_like(like, memory_format=torch.contiguous_format)
        dist.recv(buffer, self._peer(offset), group=self.group)
        return buffer


class _FromPrevious(torch.autograd.Function):
    """Forward: send `tail` to the next rank, return the previous rank's tail (zeros on rank 0).
    Backward: the gradient of what was received goes back to the previous rank; `tail`'s gradient
    comes from the next rank (zeros on the last)."""

    @staticmethod
    def forward(ctx, tail, link):
        ctx.link = link
        if not link.last:
            link.send(tail, +1)
        return torch.zeros_like(tail) if link.first else link.receive(tail, -1)

    @staticmethod
    def backward(ctx, grad_received):
        link = ctx.link
        if not link.first:
            link.send(grad_received, -1)
        return (torch.zeros_like(grad_received) if link.last else link.receive(grad_received, +1)), None


def causal_conv(upstream_conv, link, hidden_states, weight, bias=None, activation=None, **kwargs):
    """`upstream_conv` (causal_conv1d_fn) on this rank's part, its first outputs reading the previous
    rank's last `kernel - 1` inputs instead of zero padding."""
    halo = weight.shape[-1] - 1
    if halo == 0:
        return upstream_conv(hidden_states, weight, bias, activation=activation, **kwargs)
    if hidden_states.shape[-1] < halo:
        raise ValueError(
            f"adjoint sharding across processes: this rank holds {hidden_states.shape[-1]} tokens, fewer than "
            f"conv_kernel - 1 = {halo}; give every rank at least {halo} tokens of the sequence."
        )
    previous = _FromPrevious.apply(hidden_states[:, :, -halo:], link)
    extended = torch.cat([previous, hidden_states], dim=-1)
    return upstream_conv(extended, weight, bias, activation=activation, **kwargs)[:, :, halo:]


def shard_sequence(model, group=None):
    """Make `model` (Mamba / FalconMamba with `adjoint_sharding_chunk` set) run as this rank's part of
    sequences split in time over the ranks of `group` (default: the world), in rank order."""
    if not enabled(model.config):
        raise ValueError(
            "shard_sequence needs adjoint sharding: set `adjoint_sharding_chunk` (None, \"auto\", or a positive "
            "int) on the model's config first."
        )
    if getattr(model.config, "adjoint_truncation", None) is not None:
        raise ValueError(
            "shard_sequence does not support `adjoint_truncation` yet (a truncation window that crosses a rank "
            "boundary needs the next rank's output gradients); set adjoint_truncation=None for exact gradients."
        )
    if getattr(model, "is_activation_checkpointing", False):
        raise ValueError(
            "shard_sequence does not support gradient checkpointing yet (the checkpoint's recomputation would "
            "exchange states with the neighbour ranks a second time); disable it: the adjoint scan keeps no "
            "[batch, d, S, n] tensor anyway."
        )
    link = SequenceLink(group)
    mixers = [m for m in model.modules() if type(m).__name__.endswith("MambaMixer")]
    if not mixers:
        raise ValueError(f"shard_sequence: {type(model).__name__} has no Mamba mixer layers.")
    for mixer in mixers:
        mixer._mst_sequence_link = link
    return link


def sequence_part(tensor, link, dim=1):
    """This rank's part of `tensor` along `dim` (the first `S % size` ranks get one token more)."""
    return torch.tensor_split(tensor, link.size, dim=dim)[link.rank]


def shard_batch(link, input_ids, labels, attention_mask=None, ignore_index=-100):
    """This rank's model inputs for a batch of whole sequences: its part of `input_ids` (and of
    `attention_mask`), `shift_labels` (each token's next label, shifted on the WHOLE sequence so that
    a part's last token predicts the next part's first label) and `num_items_in_batch` (labelled
    tokens of the whole batch), so that the per-rank losses add up to the unsplit mean loss."""
    shift_labels = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=ignore_index)
    part = {
        "input_ids": sequence_part(input_ids, link),
        "labels": sequence_part(shift_labels, link),
        "shift_labels": sequence_part(shift_labels, link),
        "num_items_in_batch": int((shift_labels != ignore_index).sum()),
    }
    if attention_mask is not None:
        part["attention_mask"] = sequence_part(attention_mask, link)
    return part


def all_reduce_gradients(model, link):
    """Sum every parameter's gradient over the ranks (each rank's is the gradient of its part of the
    loss). A parameter that requires grad and got none on this rank raises: it would silently keep
    a partial sum."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    missing = [name for name, p in named if p.grad is None]
    if missing:
        raise RuntimeError(
            f"adjoint sharding across processes: rank {link.rank} has no gradient for {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}; run backward on this rank's loss before all_reduce_gradients."
        )
    for _, param in named:
        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=link.group)

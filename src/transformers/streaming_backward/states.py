"""The recurrent-state seam of a streamed layer: what a chunk of a recurrent mixer (Mamba2's, Gated DeltaNet's, a
short convolution's) meets in place of upstream's cache.

Upstream's recurrent layers run chunked prefill through their cache: the mixer reads the state at the chunk's start
(`cache.get_conv_state` / `cache.get_recurrent_state`), hands it to its own convolution and scan, and returns the end
state (`update_conv_state`, which also returns the earlier inputs joined to the chunk's, and `update_recurrent_state`).
`StateSeam` is a cache of ours at that seam, for one chunk: the streamed layers (recurrent.py, and layer.py where a
mixer sits beside the attention) start a chunk from the states the chunk before ended with, and in the backward from
those states as leaves (driver.py).
"""

import torch

from ..mst_core.fields import STREAMING_FIELD


# A packed batch's sequence boundaries, as a recurrent mixer's kernel reads them (Qwen3-Next's Gated DeltaNet passes
# `cu_seq_lens_q` to flash-linear-attention's scan as `cu_seqlens`): refused (RecurrentCall).
PACKED_SEQUENCE_ARGUMENTS = ("cu_seq_lens_q", "cu_seq_lens_k", "seq_idx")


class StateSeam:
    """The cache a recurrent layer's own forward meets on one chunk: the states at the chunk's start (None at the
    sequence's start), and the end states the layer hands back (`end_states`)."""

    def __init__(self, conv_state=None, recurrent_state=None):
        self.conv_state, self.recurrent_state = conv_state, recurrent_state
        self.conv_end = self.recurrent_end = None
        self.met = False  # whether the layer read its state here (else it is not a layer this seam streams)

    def get_conv_state(self, layer_idx, state_idx=0):
        self.met = True
        return self.conv_state

    def get_recurrent_state(self, layer_idx, state_idx=0):
        self.met = True
        return self.recurrent_state

    def is_recording_past(self, layer_idx):
        # True: a one-token chunk then joins its input to the conv state through `update_conv_state`, as longer
        # chunks do, instead of the decode kernel that updates the conv state in place.
        return True

    def update_conv_state(self, conv_states, layer_idx, state_idx=0, conv_kernel_size=None, **kwargs):
        """The chunk's conv inputs [B, C, T] joined after the start state's, as upstream's cache returns them (a
        sequence's first chunk shorter than the kernel padded with zeros on the left); the last `conv_kernel_size`
        columns are the end state."""
        joined = conv_states if self.conv_state is None else torch.cat([self.conv_state, conv_states], dim=-1)
        if joined.shape[-1] < conv_kernel_size:
            joined = torch.nn.functional.pad(joined, (conv_kernel_size - joined.shape[-1], 0))
        self.conv_end = joined[..., -conv_kernel_size:]
        return joined

    def update_recurrent_state(self, recurrent_states, layer_idx, state_idx=0, **kwargs):
        self.recurrent_end = recurrent_states
        return recurrent_states

    def end_states(self):
        """(conv state, recurrent state) at the chunk's end, as the next chunk starts from them."""
        return self.conv_end, self.recurrent_end


class StatesBesideKeysValues:
    """The cache of one chunk of a layer whose attention and recurrent mixer both meet it in one forward (Falcon-H1):
    the attention's `update` goes to the chunk's K/V cache (cache.py), the mixer's state calls to its `StateSeam`."""

    def __init__(self, keys_values, seam):
        self.update, self.get_seq_length = keys_values.update, keys_values.get_seq_length
        for name in ("get_conv_state", "get_recurrent_state", "is_recording_past", "update_conv_state",
                     "update_recurrent_state"):
            setattr(self, name, getattr(seam, name))


def state_chunks(seq_len, chunk):
    """[(start, end)] of chunks of `chunk` tokens for a layer carrying a state. No one-token chunk after the first:
    with a state, the mixer takes its one-token decode step, which updates the state in place after reading it for
    the output (Mamba2's `mamba2_selective_state_update`), so autograd cannot backpropagate it. Chunks of 1 are taken
    as 2, a last chunk of 1 joins the one before."""
    chunk = max(chunk, 2)
    chunks = [(start, min(start + chunk, seq_len)) for start in range(0, seq_len, chunk)]
    if len(chunks) > 1 and chunks[-1][1] - chunks[-1][0] == 1:
        chunks[-2:] = [(chunks[-2][0], seq_len)]
    return chunks


def refuse_packed_sequences(layer, arguments):
    packed = [name for name in PACKED_SEQUENCE_ARGUMENTS if arguments.get(name) is not None]
    if packed:
        raise ValueError(
            f"{STREAMING_FIELD}: {type(layer).__name__} got packed sequences (`{packed[0]}`), which a streamed "
            "recurrent layer does not take yet: each chunk's scan would read the whole sequence's boundaries. "
            "Pad the sequences instead of packing them, or unset the field."
        )


def missing_state_gradient(layer, start):
    """The error of a chunk whose start state got no gradient."""
    # The chunk's output depends on the state it started from; a scan (a fused kernel) that takes the state without
    # its gradient would silently cut the sequence's gradient at the boundary.
    return RuntimeError(
        f"streaming backward: {type(layer).__name__}'s chunk from token {start} returned no gradient for the state it "
        "started from (its scan or convolution took the carried state without a gradient path); refusing to drop it. "
        f"Unset {STREAMING_FIELD}, or run the mixer's PyTorch path (uninstall the kernel package it uses)."
    )

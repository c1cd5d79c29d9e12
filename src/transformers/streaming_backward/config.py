"""Chunk-size policy for the ``streaming_backward_chunk`` config field (its validation: mst_core/fields.py)."""

from ..mst_core.fields import STREAMING_ALLOWED, STREAMING_FIELD, hidden_size_chunk


# Streaming "auto": `hidden_size` query tokens, as MsT's MLP mini-sequences (C = d). Measured (bench
# `streaming` sweep, CPU, d=256, 2 layers, S=8192, fp32, both flags; vs mini_sequence+checkpointing):
# chunk 256 = d: step time 1.13x, activation memory 0.81x; 512: 1.22x, 0.87x; 1024: 1.30x, 1.11x;
# 2048: 1.43x, 1.60x; 4096: 1.36x, 2.57x. Larger chunks cost memory (one chunk's working set) and time:
# the chunk's diagonal block is computed in full under the mask (c * S / 2 wasted attention per layer),
# and with mini_sequence_chunk="auto" a streamed chunk longer than d makes the MLP a mini-sequence
# Function of its own, recomputed once more in its backward; a chunk of d tokens runs the MLP unsplit.
def streaming_chunk_size(value, hidden_size: int) -> int:
    """Query tokens per streamed chunk for `streaming_backward_chunk=value`."""
    return hidden_size_chunk(STREAMING_FIELD, value, STREAMING_ALLOWED, hidden_size)

"""Chunk-size policy for the ``streaming_backward_chunk`` config field (its validation: mst_core/fields.py)."""

from ..mst_core.fields import STREAMING_ALLOWED, STREAMING_FIELD, hidden_size_chunk


# Streaming "auto": `hidden_size` query tokens (as MsT's MLP mini-sequences, C = d), and at least this many. Each
# chunk's attention backward writes dK/dV over the chunk's whole key prefix (then added into the sums), S^2 / (2C)
# rows per layer in all, so small chunks cost time for no memory the step's peak shows. Measured (CPU, 2 threads,
# S=16K, fp32, Llama-style d=256, 2 layers, one run; docs/streaming.md): the chunks' attention forward + backward
# 4.66 s with C=256, 3.80 s with 1024, 3.84 s with 2048 (unsplit causal: 3.67-3.71 s); the step with both flags 0.88x
# the speed of mini_sequence+checkpointing with C=256, 0.97x with 1024, peak the same (457.2 MiB). Real models have
# d >= 1024 (the floor changes nothing there). Inside a streamed chunk the mini-sequence MLP runs unsplit
# (mst_core/chunks.py), so a chunk longer than the MLP's mini-sequences adds no recompute.
MIN_AUTO_CHUNK = 1024


def streaming_chunk_size(value, hidden_size: int) -> int:
    """Query tokens per streamed chunk for `streaming_backward_chunk=value` ("auto": max(hidden_size, 1024))."""
    chunk = hidden_size_chunk(STREAMING_FIELD, value, STREAMING_ALLOWED, hidden_size)
    return max(chunk, MIN_AUTO_CHUNK) if value == "auto" else chunk

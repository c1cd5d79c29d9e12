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
# On an accelerator (any device but the CPU) a streamed chunk's forward, recompute and backward are host work the GPU
# waits for (docs/cuda/README.md: on an H200, Llama-3.2-1B shapes at 16K, `streaming` took 0.810 s in chunks of
# 2048, 0.721 s in 4096 and 0.679 s in 8192, same peak). The price with mini-sequences, planned (cuda_check.py
# --planner-only --streaming-chunk): 10.19 GiB at 16K either way, 10.28 -> 10.55 at 32K, 12.73 -> 12.93 at 64K;
# chunks of 8192 cost 0.5-0.8 GiB. As the mini-sequence MLP's floor (mini_sequence/config.py).
MIN_AUTO_CHUNK_ACCELERATOR = 4096


def streaming_chunk_size(value, hidden_size: int, device_type: str = "cpu") -> int:
    """Query tokens per streamed chunk for `streaming_backward_chunk=value` ("auto": max(hidden_size, 1024), on an
    accelerator max(hidden_size, 4096))."""
    chunk = hidden_size_chunk(STREAMING_FIELD, value, STREAMING_ALLOWED, hidden_size)
    if value != "auto":
        return chunk
    return max(chunk, MIN_AUTO_CHUNK if device_type == "cpu" else MIN_AUTO_CHUNK_ACCELERATOR)

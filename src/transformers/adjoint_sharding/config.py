"""Shard-size policy for the adjoint-sharding config fields (Mamba, FalconMamba); their validation:
mst_core/fields.py. Importable without torch.

- ``adjoint_sharding_chunk``: ``None`` (off, upstream scan), ``"auto"`` or a positive int: tokens per
  shard of the selective scan's adjoint backward (the adjoint sharding paper, §4.1-4.2).
- ``adjoint_truncation``: ``None`` (exact gradients) or a positive int T: truncated adjoint sharding
  (the adjoint sharding paper, §4.3): the gradient of each token's output reaches back at most T state transitions
  of each layer's scan. An approximation, unlike everything else in this distribution.
"""

from ..mst_core.fields import ADJOINT_CHUNK_ALLOWED, ADJOINT_CHUNK_FIELD, validate_chunk_field


# "auto": tokens per shard. Measured (bench `mamba` sweep, shards part; CPU, MambaForCausalLM d=256,
# N=16, expand 2, 4 layers, V=32000, S=8192, fp32, mini_sequence_chunk="auto", full training step;
# one timed step each on 2 shared cores at load average 8-10, so small time differences are noise):
# shard 64: peak 838.7 MiB, 82.7 s; 128: 839.3 MiB, 91.9 s; 256: 864.1 MiB, 99.9 s; 512: 922.6 MiB,
# 101.1 s; 1024: 1036.1 MiB, 94.4 s; 2048: 1271.2 MiB, 126.8 s. A shard's working set ([shard, batch,
# D, N] fp32 states, adjoints, a, b) grows with the shard; its Python cost (about 2 sqrt(shard) scan
# steps per shard, 2 S / sqrt(shard) per layer) is small at these sizes: time did not separate
# 64-1024 beyond the noise. A second run, 128 against 256 only, median of 2 interleaved steps each
# (load average about 6.5): 128: 43.9 s, 256: 48.1 s, peaks as above. 128 has the smallest peak
# (64's, within 0.1%) with half as many shards as 64.
AUTO_SHARD_TOKENS = 128


def shard_tokens(chunk) -> int:
    """Tokens per scan shard for ``adjoint_sharding_chunk=chunk``."""
    validate_chunk_field(ADJOINT_CHUNK_FIELD, chunk, ADJOINT_CHUNK_ALLOWED)
    if chunk is None:
        raise ValueError(f"`{ADJOINT_CHUNK_FIELD}` is None: adjoint sharding is off")
    return AUTO_SHARD_TOKENS if chunk == "auto" else chunk

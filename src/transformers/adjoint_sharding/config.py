"""Validation and shard-size policy for the adjoint-sharding config fields (Mamba, FalconMamba).

Importable without torch: configuration classes call these at construction time.

- ``adjoint_sharding_chunk``: ``None`` (off, upstream scan), ``"auto"`` or a positive int: tokens per
  shard of the selective scan's adjoint backward (the adjoint sharding paper, §4.1-4.2).
- ``adjoint_truncation``: ``None`` (exact gradients) or a positive int T: truncated adjoint sharding
  (the adjoint sharding paper, §4.3): the gradient of each token's output reaches back at most T state transitions
  of each layer's scan. An approximation, unlike everything else in this distribution.
"""

from ..mini_sequence.config import _validate_chunk_field


CHUNK_FIELD_NAME = "adjoint_sharding_chunk"
CHUNK_ALLOWED_DESCRIPTION = 'None, "auto", or a positive int (tokens per scan shard)'
TRUNCATION_FIELD_NAME = "adjoint_truncation"
TRUNCATION_ALLOWED_DESCRIPTION = "None (exact gradients) or a positive int (state transitions each gradient reaches back)"


def validate_adjoint_sharding(chunk, truncation):
    """Raise ``ValueError`` naming the field unless both values are valid and consistent."""
    _validate_chunk_field(CHUNK_FIELD_NAME, chunk, CHUNK_ALLOWED_DESCRIPTION)
    if truncation == "auto":
        raise ValueError(f"Invalid `{TRUNCATION_FIELD_NAME}`='auto': expected {TRUNCATION_ALLOWED_DESCRIPTION}.")
    _validate_chunk_field(TRUNCATION_FIELD_NAME, truncation, TRUNCATION_ALLOWED_DESCRIPTION)
    if truncation is not None and chunk is None:
        raise ValueError(
            f"`{TRUNCATION_FIELD_NAME}`={truncation!r} needs `{CHUNK_FIELD_NAME}` to be set (truncation is a "
            f"variant of the adjoint backward); set `{CHUNK_FIELD_NAME}` to {CHUNK_ALLOWED_DESCRIPTION}."
        )


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
    _validate_chunk_field(CHUNK_FIELD_NAME, chunk, CHUNK_ALLOWED_DESCRIPTION)
    if chunk is None:
        raise ValueError(f"`{CHUNK_FIELD_NAME}` is None: adjoint sharding is off")
    return AUTO_SHARD_TOKENS if chunk == "auto" else chunk

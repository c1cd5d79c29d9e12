"""Validation and shard-size policy for the adjoint-sharding config fields (Mamba, FalconMamba).

Importable without torch: configuration classes call these at construction time.

- ``adjoint_sharding_chunk``: ``None`` (off, upstream scan), ``"auto"`` or a positive int: tokens per
  shard of the selective scan's adjoint backward (seed 003, §4.1-4.2).
- ``adjoint_truncation``: ``None`` (exact gradients) or a positive int T: truncated adjoint sharding
  (seed 003, §4.3): the gradient of each token's output reaches back at most T state transitions
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


# "auto": tokens per shard. See README "Adjoint sharding" for the measurement behind it.
AUTO_SHARD_TOKENS = 256


def shard_tokens(chunk) -> int:
    """Tokens per scan shard for ``adjoint_sharding_chunk=chunk``."""
    _validate_chunk_field(CHUNK_FIELD_NAME, chunk, CHUNK_ALLOWED_DESCRIPTION)
    if chunk is None:
        raise ValueError(f"`{CHUNK_FIELD_NAME}` is None: adjoint sharding is off")
    return AUTO_SHARD_TOKENS if chunk == "auto" else chunk

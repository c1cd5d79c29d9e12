"""Validation of every config field of ours (the README's field table), importable without torch: the configuration
classes call these at construction time (patches 0002, 0007, 0010) and the model checks at `post_init`.

- ``mini_sequence_chunk`` (mini_sequence/): None (off), ``"auto"`` or a positive int (tokens per mini-sequence).
- ``streaming_backward_chunk`` (streaming_backward/): None (off), ``"auto"`` or a positive int (query tokens per
  streamed chunk).
- ``adjoint_sharding_chunk`` (adjoint_sharding/): None (off, upstream scan), ``"auto"`` or a positive int (tokens per
  shard of the selective scan's adjoint backward).
- ``adjoint_truncation`` (adjoint_sharding/): None (exact gradients) or a positive int T, with
  ``adjoint_sharding_chunk`` set: each gradient reaches back at most T state transitions (an approximation).

What ``"auto"`` means is each method's chunk policy (its ``config.py``).
"""


MINI_SEQUENCE_FIELD = "mini_sequence_chunk"
MINI_SEQUENCE_ALLOWED = 'None, "auto", or a positive int (tokens per mini-sequence)'
STREAMING_FIELD = "streaming_backward_chunk"
STREAMING_ALLOWED = 'None, "auto", or a positive int (query tokens per streamed chunk)'
ADJOINT_CHUNK_FIELD = "adjoint_sharding_chunk"
ADJOINT_CHUNK_ALLOWED = 'None, "auto", or a positive int (tokens per scan shard)'
ADJOINT_TRUNCATION_FIELD = "adjoint_truncation"
ADJOINT_TRUNCATION_ALLOWED = "None (exact gradients) or a positive int (state transitions each gradient reaches back)"


def validate_chunk_field(field_name: str, value, allowed: str):
    """Return ``value`` unchanged if it is None, ``"auto"`` or a positive int, else raise ``ValueError``.

    ``bool`` is rejected although it subclasses ``int`` (``True`` would silently mean chunks
    of 1 token); floats are rejected even when integral (``4.0``), so that a typo or a
    JSON round-trip surprise is reported rather than guessed at.
    """
    if value is None:
        return value
    if isinstance(value, str) and value == "auto":
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    raise ValueError(f"Invalid `{field_name}`={value!r}: expected {allowed}.")


def validate_mini_sequence_chunk(value):
    """Return ``value`` unchanged if it is a valid ``mini_sequence_chunk``, else raise ``ValueError``."""
    return validate_chunk_field(MINI_SEQUENCE_FIELD, value, MINI_SEQUENCE_ALLOWED)


def validate_streaming_backward_chunk(value):
    """Return ``value`` unchanged if it is a valid ``streaming_backward_chunk``, else raise ``ValueError``."""
    return validate_chunk_field(STREAMING_FIELD, value, STREAMING_ALLOWED)


def validate_adjoint_sharding(chunk, truncation):
    """Raise ``ValueError`` naming the field unless both values are valid and consistent."""
    validate_chunk_field(ADJOINT_CHUNK_FIELD, chunk, ADJOINT_CHUNK_ALLOWED)
    if truncation == "auto":
        raise ValueError(f"Invalid `{ADJOINT_TRUNCATION_FIELD}`='auto': expected {ADJOINT_TRUNCATION_ALLOWED}.")
    validate_chunk_field(ADJOINT_TRUNCATION_FIELD, truncation, ADJOINT_TRUNCATION_ALLOWED)
    if truncation is not None and chunk is None:
        raise ValueError(
            f"`{ADJOINT_TRUNCATION_FIELD}`={truncation!r} needs `{ADJOINT_CHUNK_FIELD}` to be set (truncation is a "
            f"variant of the adjoint backward); set `{ADJOINT_CHUNK_FIELD}` to {ADJOINT_CHUNK_ALLOWED}."
        )


def hidden_size_chunk(field_name: str, value, allowed: str, hidden_size: int) -> int:
    """A chunk field's tokens per chunk: ``"auto"`` -> ``hidden_size``; None raises (the feature is off)."""
    validate_chunk_field(field_name, value, allowed)
    if value is None:
        raise ValueError(f"`{field_name}` is None: the feature it sets is disabled")
    if value == "auto":
        return int(hidden_size)
    return value

"""Adjoint sharding for state-space models (seed 003): the selective scan's backward as a reverse
recurrence of adjoint states plus per-shard vector-Jacobian products, exact or truncated.

Importing this package does not import torch: configuration classes import `.config`.
"""

from .config import shard_tokens, validate_adjoint_sharding


__all__ = ["validate_adjoint_sharding", "shard_tokens"]

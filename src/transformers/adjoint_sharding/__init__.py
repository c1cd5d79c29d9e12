"""Adjoint sharding for state-space models (Xu et al., "Adjoint sharding for very long context training of state
space models", TMLR, https://openreview.net/forum?id=kQCuMcEneq): the selective scan's backward as a reverse
recurrence of adjoint states plus per-shard vector-Jacobian products, exact or truncated.

Importing this package does not import torch.
"""

from .config import shard_tokens


__all__ = ["shard_tokens"]

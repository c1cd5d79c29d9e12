"""Mini-sequence (sequence-chunked) MLP and LM-head loss, after the Mini-Sequence Transformer
paper (MsT, Algorithms 1-4).

Importing this package does not import torch: configuration classes import the validation
helpers from ``.config``. The torch-based names are loaded on first access.
"""

from .config import (
    lm_head_chunk_size,
    mlp_chunk_size,
    validate_mini_sequence_chunk,
    validate_streaming_backward_chunk,
)


_LAZY = {
    "mini_sequence_mlp": ".mlp",
    "module_forward": ".mlp",
    "mini_sequence_causal_lm_loss": ".loss",
    "LiveTensorTracker": ".memory",
}

__all__ = [
    "validate_mini_sequence_chunk",
    "validate_streaming_backward_chunk",
    "mlp_chunk_size",
    "lm_head_chunk_size",
    *_LAZY,
]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""Mini-sequence (sequence-chunked) MLP and LM-head loss, after the Mini-Sequence Transformer
paper (MsT, Algorithms 1-4).

Importing this package does not import torch: the torch-based names are loaded on first access. The field's
validation is mst_core/fields.py (shared by every method); what the patched model files call is `integration.py`.
"""

from .config import lm_head_chunk_size, mlp_chunk_size


_LAZY = {
    "mini_sequence_mlp": ".mlp",
    "module_forward": ".mlp",
    "mini_sequence_causal_lm_loss": ".loss",
}

__all__ = [
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

"""StreamBP (arXiv 2506.03077, §3.2.2): a decoder layer's own forward run query chunk by query chunk, with an
exact streamed backward, for any family whose attention goes through the `Cache` seam (see layer.py)."""

from .layer import decoder_layer_forward, streams


__all__ = ["decoder_layer_forward", "streams"]

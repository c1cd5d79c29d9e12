"""StreamBP (arXiv 2506.03077, §3.2.2): exact streaming backward through whole decoder layers.

`modeling_layers.GradientCheckpointingLayer` (patch 0008) asks `applies(layer)` before it would checkpoint and, if
so, runs `decoder_layer_forward` instead: the layer's own forward per query chunk (layer.py), its keys/values met
at the `Cache` seam (cache.py), each chunk's mask and key range from masks.py, row-wise gradients in row blocks
(rows.py), the input kept on the device or offloaded (offload.py), the wrappers' rules (wrappers.py), what a
streamed layer refuses (checks.py), its chunk policy (config.py) and, under torch.compile, the call as one operator
of the graph (compiled.py). The
model types it streams are the registry's (mst_core/families.py).
"""

from .layer import applies, decoder_layer_forward


__all__ = ["applies", "decoder_layer_forward"]

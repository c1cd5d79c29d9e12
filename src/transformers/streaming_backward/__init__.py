"""StreamBP (arXiv 2506.03077, §3.2.2): exact streaming backward through whole decoder layers.

`modeling_layers.GradientCheckpointingLayer` (patch 0008) asks `applies(layer)` before it would checkpoint and, if
so, runs `decoder_layer_forward` instead. Two implementations sit behind these entry points today:

- layer.py: the generic streamed layer, the layer's own forward per query chunk with its K/V met at the `Cache`
  seam (cache.py, masks.py). Every model type whose entry in `mini_sequence/families.py` says `streaming="generic"` runs it.
- mini_sequence/streaming.py: the hand-written Llama-like / Gemma-2 layouts, still the path of llama, mistral,
  qwen2 and gemma2 (its CPU key slabs, FlashAttention chunks, row blocks and the memory planner are not ported
  yet); `layer.EVERY_LAYER = True` sends those through layer.py too.

The functions look the implementation up at call time (tests and tools patch `mini_sequence.streaming`).
"""


def applies(layer) -> bool:
    """Whether `layer`'s forward should stream (called by GradientCheckpointingLayer for every layer)."""
    from ..mini_sequence import streaming

    return streaming.applies(layer)


def decoder_layer_forward(forward, layer, *args, **kwargs):
    """Streamed training forward of `layer` (`forward`: the layer class's own forward)."""
    from ..mini_sequence import streaming

    return streaming.decoder_layer_forward(forward, layer, *args, **kwargs)


__all__ = ["applies", "decoder_layer_forward"]

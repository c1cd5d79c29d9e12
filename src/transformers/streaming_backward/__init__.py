"""StreamBP (arXiv 2506.03077, §3.2.2): exact streaming backward through whole decoder layers.

`modeling_layers.GradientCheckpointingLayer` (patch 0008) asks `applies(layer)` before it would checkpoint and, if
so, runs `decoder_layer_forward` instead: the layer's own forward per query chunk (layer.py; its backward,
backward.py), its keys/values met at the `Cache` seam (cache.py), each chunk's mask and key range from masks.py,
row-wise gradients in row blocks (rows.py), the input kept on the device or offloaded (offload.py), the wrappers'
rules (wrappers.py), what a streamed layer refuses (checks.py), its chunk policy (config.py) and, under
torch.compile, the call as one operator of the graph (compiled.py). A recurrent layer (Mamba2's) streams through its
conv and recurrent states instead (recurrent.py). The model types it streams are the registry's
(mst_core/families.py).
"""

from ..mst_core.families import FAMILIES
from ..mst_core.fields import STREAMING_FIELD
from ..mst_core.model_checks import CONSTRUCTION_HOOKS, text_config
from .layer import applies, decoder_layer_forward


def _name_layers_for_compile(model) -> None:
    """At model construction, with the field set: keys for the decoder layers (compiled.py's operator)."""
    config = text_config(model.config)
    if getattr(config, STREAMING_FIELD, None) is not None:
        from . import compiled

        compiled.register_layers(model)


def _config_for_layers(model) -> None:
    """At model construction, for a family with recurrent layers that stream (the registry's `streaming_recurrent`):
    the model's config on each decoder layer that keeps none (Bamba's and Granite-4.0-H's Mamba layers), for
    `parts.layer_config`, and a mark on each module inside a decoder layer (`parts.inside_a_layer`); other models are
    left as upstream builds them. An inner model (a composite's text model) runs this first: its config stays."""
    from ..modeling_layers import GradientCheckpointingLayer
    from .parts import layer_config

    config = text_config(model.config)
    if getattr(FAMILIES.get(getattr(config, "model_type", None)), "streaming_recurrent", None) is None:
        return
    for module in model.modules():
        if isinstance(module, GradientCheckpointingLayer):
            if layer_config(module) is None:
                module._streaming_config = config
            for inner in module.modules():  # inside this one (Zamba2's Mamba2 decoder layer in a hybrid layer)
                if inner is not module:
                    inner._mst_inside_layer = True


CONSTRUCTION_HOOKS.append(_name_layers_for_compile)
CONSTRUCTION_HOOKS.append(_config_for_layers)


__all__ = ["applies", "decoder_layer_forward"]

"""Which parts of a decoder layer the streamed layer meets, found the same way by every module of the package
(layer.py, recurrent.py, compiled.py, checks.py, wrappers.py): the layer's model config, its recurrent mixer, its
attention module, and how many values its own forward returns. The registry (mst_core/families.py) names what
differs by family."""

from ..mst_core.families import FAMILIES


def _family(layer):
    return FAMILIES.get(getattr(layer_config(layer), "model_type", None))


def layer_config(layer):
    """The model config a decoder layer was built from: its own (Mamba2's block keeps it), else its attention's or its
    MLP / MoE block's (a hybrid's linear-attention layer keeps none of its own: Qwen3-Next's); None for a module
    without one."""
    for owner in (layer, getattr(layer, "self_attn", None), getattr(layer, "mlp", None)):
        config = getattr(owner, "config", None)
        if config is not None:
            return config
    # A layer keeping none (Bamba's and Granite-4.0-H's Mamba layers): the model's, set at construction (__init__.py)
    return getattr(layer, "_streaming_config", None)


def _nested(layer):
    """The registry's `streaming_nested` paths of `layer`'s class (attention, mixer, mask argument), or None."""
    nested = getattr(_family(layer), "streaming_nested", None) or {}
    return next((nested[c.__name__] for c in type(layer).__mro__ if c.__name__ in nested), None)


def _at(module, path):
    for name in path.split("."):
        module = getattr(module, name, None)
    return module


def recurrent_mixer(layer):
    """The recurrent mixer module of `layer` (the registry's `streaming_recurrent` attribute, or its `streaming_nested`
    path), or None: Mamba2's `mixer`, a hybrid's `linear_attn` (absent on its attention layers)."""
    nested = _nested(layer)
    if nested is not None:
        return _at(layer, nested[1])
    name = getattr(_family(layer), "streaming_recurrent", None)
    # A hybrid keeping every block's mixer under that one attribute (Nemotron-H's `mixer`: Mamba2, attention, MLP or
    # MoE, by the block's `block_type`): its linear-attention blocks only.
    if name is None or getattr(layer, "block_type", "linear_attention") != "linear_attention":
        return None
    # A recurrent mixer keeps a conv state (`conv_kernel_size`, handed to `update_conv_state`): not LFM2's
    # `Lfm2ShortConv` asked about itself (its own config, and an `nn.Conv1d` under the registry's name `conv`).
    mixer = getattr(layer, name, None)
    return mixer if hasattr(mixer, "conv_kernel_size") else None


def positionwise_mixer(layer):
    """The block of a hybrid's layer that mixes no tokens (Nemotron-H's `mixer` on its "mlp" and "moe" blocks, the
    registry's `streaming_recurrent` attribute): such a layer streams by chunks of tokens with no state to carry
    (recurrent.py), as checkpointing would recompute it; None for any other layer."""
    name = getattr(_family(layer), "streaming_recurrent", None)
    if name is None or getattr(layer, "block_type", None) not in ("mlp", "moe"):
        return None
    return getattr(layer, name, None)


def mixer_beside_attention(layer):
    """The recurrent mixer of a layer that also has attention, side by side in one forward (Falcon-H1's `mamba` beside
    its `self_attn`): the layer streams by query chunks with the mixer's states carried from chunk to chunk (layer.py);
    None for any other layer (a hybrid's layers are one kind or the other; Kimi-Linear's `self_attn` is either)."""
    mixer, attn = recurrent_mixer(layer), attention_module(layer)
    return mixer if mixer is not None and attn is not None and mixer is not attn else None


def attention_module(layer):
    """The attention module of `layer` that meets the K/V cache: `self_attn`, else a hybrid block's mixer where it is
    attention (Nemotron-H's `mixer` on its "full_attention" blocks, the registry's `streaming_recurrent` attribute);
    None for a layer without one."""
    nested = _nested(layer)
    if nested is not None:
        return _at(layer, nested[0])
    attn = getattr(layer, "self_attn", None)
    if attn is None and getattr(layer, "block_type", None) == "full_attention":
        name = getattr(_family(layer), "streaming_recurrent", None)
        attn = None if name is None else getattr(layer, name, None)
    return attn


def attention_mask_argument(layer):
    """The name of the decoder layer's argument that carries its attention's mask: `attention_mask`, or the registry's
    (Zamba2's hybrid layers take the mixer's padding mask as `attention_mask` and the attention's as `causal_mask`)."""
    nested = _nested(layer)
    return "attention_mask" if nested is None else nested[2]


def inside_a_layer(layer):
    """Whether `layer` is a module inside a decoder layer (Zamba2's Mamba2 decoder layer and shared attention block
    in a hybrid layer): it runs as part of that one, in its chunks (marked at construction for the families with
    recurrent layers, streaming_backward/__init__.py)."""
    return getattr(layer, "_mst_inside_layer", False)


def returned(layer, out):
    """`out` as the layer's own forward returns it: Bamba's decoder layer returns (hidden states, attention weights),
    Falcon-H1's (hidden states,), which their models unpack (the registry's `streaming_layer_returns`); the weights are
    never whole here (checks.check_captured_outputs refuses recording them): None in their place."""
    returns = getattr(_family(layer), "streaming_layer_returns", None)
    return out if returns is None else (out, *(None,) * (returns - 1))

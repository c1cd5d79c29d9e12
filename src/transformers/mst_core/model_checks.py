"""Checks every model runs at construction (patch 0005 calls `check_model` from `post_init`), and the config
fields of ours that `from_pretrained` / `AutoConfig.from_pretrained` accept on every model type (patch 0014).

Imported by modeling_utils and configuration_utils, so it imports nothing heavy.
"""

import inspect

from ..utils import logging
from .families import model_types, streaming_model_types, streaming_refusal
from .fields import (
    ADJOINT_CHUNK_FIELD,
    ADJOINT_TRUNCATION_FIELD,
    MINI_SEQUENCE_FIELD,
    STREAMING_FIELD,
    validate_adjoint_sharding,
    validate_mini_sequence_chunk,
    validate_streaming_backward_chunk,
)


logger = logging.get_logger(__name__)

# Views of the registry (families.py) by what each check needs.
# mini_sequence_chunk's MLP or MoE block, final norm, LM head + loss (patches 0002-0004, 0012).
MINI_SEQUENCE_MODEL_TYPES = model_types(mini_sequence=("mlp", "moe"))
# Composite models whose own LM head + loss is chunked when their text config sets mini_sequence_chunk.
TEXT_CONFIG_LM_HEAD_MODEL_TYPES = model_types(mini_sequence="text_config")
# streaming_backward_chunk: the layer's own forward per query chunk (streaming_backward/layer.py).
STREAMING_MODEL_TYPES = streaming_model_types()
# State-space models: adjoint sharding; they have no MLP, so mini_sequence_chunk chunks their LM head + loss.
ADJOINT_MODEL_TYPES = model_types(adjoint=True)
# Each field of ours -> the model types that have its path. Set on any other model type, a field is validated,
# saved with the config and ignored, with a warning.
FIELD_MODEL_TYPES = {
    MINI_SEQUENCE_FIELD: model_types(mini_sequence=("mlp", "moe", "lm_head")),
    STREAMING_FIELD: STREAMING_MODEL_TYPES,
    ADJOINT_CHUNK_FIELD: ADJOINT_MODEL_TYPES,
    ADJOINT_TRUNCATION_FIELD: ADJOINT_MODEL_TYPES,
}
CONFIG_FIELDS = tuple(FIELD_MODEL_TYPES)


def carry_fields_to_text_config(composite_config, text_config) -> None:
    """Our fields set on a composite checkpoint's config, onto its text config, where AutoModelForCausalLM builds the
    text model alone from the latter (patch 0014 in models/auto/auto_factory.py: Qwen3.5's `qwen3_5` checkpoints give
    Qwen3_5ForCausalLM). `from_pretrained(path, mini_sequence_chunk=...)` puts the field on the composite's config,
    which upstream then drops (as it would the dtype, which it re-injects): the field was silently lost."""
    for field in CONFIG_FIELDS:
        value = getattr(composite_config, field, None)
        if value is not None:
            setattr(text_config, field, value)


def validate_fields(config) -> None:
    """Raise ``ValueError`` naming the field for any invalid value of ours on ``config`` (absent fields are None)."""
    validate_mini_sequence_chunk(getattr(config, MINI_SEQUENCE_FIELD, None))
    validate_streaming_backward_chunk(getattr(config, STREAMING_FIELD, None))
    validate_adjoint_sharding(getattr(config, ADJOINT_CHUNK_FIELD, None), getattr(config, ADJOINT_TRUNCATION_FIELD, None))


# Called with each model `check_model` sees, after its checks: packages above mst_core add theirs here (mst_core
# imports none of them), e.g. streaming_backward/__init__.py names the decoder layers for a compiled graph.
CONSTRUCTION_HOOKS = []


def text_config(config):
    """The config a model's text stack reads our fields from: a composite's text config (`get_text_config`), or the
    model's own. Construction hooks look here: the patched layers read the field from their own (text) config."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _fields_config(config):
    """The config our fields apply from: the Gemma-3, Gemma-4, Qwen3-VL and Qwen3-VL-MoE composites (`text_config` in
    the registry) read them from their text config, where their text stack and their head look; any other model its
    own."""
    if getattr(config, "model_type", None) in TEXT_CONFIG_LM_HEAD_MODEL_TYPES:
        return config.get_text_config()
    return config


def check_model(model) -> None:
    """Validate every field of ours on `model.config`; warn once per model type for each field it would ignore.

    The configs of the supported families validate their fields at construction; this catches a value set
    afterwards, e.g. by `from_pretrained(path, mini_sequence_chunk=...)`, which assigns it to the loaded config,
    and any value on a model type whose config has no such field (from_pretrained or config.json).
    """
    config = model.config
    model_type = getattr(config, "model_type", None)
    validate_fields(config)
    fields_config = _fields_config(config)
    if fields_config is not config:
        # `from_pretrained(path, mini_sequence_chunk=...)` (AutoModelForImageTextToText too) puts the field on the
        # composite's config: carried to where it applies, and checked there.
        carry_fields_to_text_config(config, fields_config)
        validate_fields(fields_config)
    if any(getattr(fields_config, field, None) is not None for field in CONFIG_FIELDS):
        model.register_forward_pre_hook(check_forwards_at_first_training_step)
    for hook in CONSTRUCTION_HOOKS:
        hook(model)
    config, model_type = fields_config, getattr(fields_config, "model_type", None)
    for field, field_model_types in FIELD_MODEL_TYPES.items():
        value = getattr(config, field, None)
        if value is not None and model_type not in field_model_types:
            # One message per model type and field: `*Model` and `*ForCausalLM` both run post_init.
            logger.warning_once(
                f"model_type={model_type!r} has no {field} path: {field}={value!r} is ignored. "
                f"It applies to model types {', '.join(field_model_types)}."
            )
    refusal = streaming_refusal(config) if getattr(config, STREAMING_FIELD, None) is not None else None
    if refusal is not None:
        logger.warning_once(
            f"model_type={model_type!r} with {refusal}: {STREAMING_FIELD}={getattr(config, STREAMING_FIELD)!r} is "
            "ignored (a layer reading what another layer computed needs it whole); the layers run upstream's way."
        )
    # A composite model (LLaVA & co) with the flag on its text config: the language model's MLP is
    # split, but the composite's own LM head + loss is upstream's. Say so rather than half-apply it.
    text = text_config(config)
    text_value = getattr(text, MINI_SEQUENCE_FIELD, None)
    lm_head_types = MINI_SEQUENCE_MODEL_TYPES + TEXT_CONFIG_LM_HEAD_MODEL_TYPES
    if text is not config and text_value is not None and model_type not in lm_head_types:
        logger.warning_once(
            f"{type(model).__name__} (model_type={model_type!r}): text_config.mini_sequence_chunk={text_value!r} "
            f"splits the language model's MLP into mini-sequences, but {type(model).__name__} computes its LM head "
            "and loss upstream's way (full [batch, seq, vocab] logits): only model types "
            f"{', '.join(lm_head_types)} chunk the LM head."
        )


def foreign_forward(module) -> str | None:
    """Where `module`'s forward comes from when that is not transformers (Liger-Kernel binds its own forward to
    instances, or replaces the class), else None. Wrappers that may call the original (accelerate's hooks, TRL's
    fused LM head, FSDP2's subclass, our checkpointing wrapper) name it as theirs through `functools.wraps`."""
    forward = inspect.unwrap(module.__dict__.get("forward", type(module).forward))
    function = getattr(forward, "__func__", forward)
    where = getattr(function, "__module__", None) or "?"
    if where.startswith("transformers."):
        return None
    return f"{where}.{getattr(function, '__qualname__', repr(function))}"


def _bypassed(what: str, modules) -> list[str]:
    """One line per foreign forward among `modules` (one per source: all MLPs replaced alike make one line)."""
    sources = {foreign_forward(module): type(module).__name__ for module in modules}
    return [f"{what} ({name}.forward is {where})" for where, name in sources.items() if where]


def _named(model, attribute: str):
    return [module for name, module in model.named_modules() if name.rsplit(".", 1)[-1] == attribute]


def _replaced_paths(model) -> list[str]:
    """One line per path of ours that a foreign forward bypasses in `model`."""
    from ..modeling_layers import GradientCheckpointingLayer

    config = _fields_config(model.config)
    found = []
    if getattr(config, MINI_SEQUENCE_FIELD, None) is not None:
        if hasattr(model, "lm_head"):
            found += _bypassed(f"{MINI_SEQUENCE_FIELD}: the chunked LM head + loss", [model])
        found += _bypassed(f"{MINI_SEQUENCE_FIELD}: the mini-sequence MLP", _named(model, "mlp"))
    if getattr(config, STREAMING_FIELD, None) is not None:
        layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
        found += _bypassed(f"{STREAMING_FIELD}: streamed layers", layers)
    if getattr(config, ADJOINT_CHUNK_FIELD, None) is not None:
        found += _bypassed(f"{ADJOINT_CHUNK_FIELD}: the adjoint scan", _named(model, "mixer"))
    return found


def check_forwards_at_first_training_step(model, args) -> None:
    """Forward pre-hook that `check_model` registers on a model with a field of ours set: at the first training
    forward, warn about each of our paths that a replaced forward bypasses (Liger-Kernel's `use_liger_kernel=True`
    or `apply_liger_kernel_to_*` replace the MLPs and `*ForCausalLM.forward`, which then never call us), then
    remove itself (no cost on later steps). Under torch.compile it does nothing: removing a hook while tracing breaks
    the graph, so the check runs only at an eager training forward."""
    import torch

    if torch.compiler.is_compiling() or not (model.training and torch.is_grad_enabled()):
        return
    for key in [k for k, hook in model._forward_pre_hooks.items() if hook is check_forwards_at_first_training_step]:
        del model._forward_pre_hooks[key]
    for line in _replaced_paths(model):
        logger.warning_once(
            f"{line}: that path of transformers-mst does not run, the replacement's does (its memory and its "
            "gradients, not ours). Remove the replacement (e.g. use_liger_kernel=False) to use ours, or unset the field."
        )

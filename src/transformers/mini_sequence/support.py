"""Checks every model runs at construction (patch 0005 calls `check_model` from `post_init`).

Imported by modeling_utils, so it imports nothing heavy.
"""

from ..adjoint_sharding.config import validate_adjoint_sharding
from ..utils import logging
from .config import validate_mini_sequence_chunk


logger = logging.get_logger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral", "gemma2")
# State-space models: adjoint sharding; they have no MLP, so mini_sequence_chunk chunks their LM head + loss.
ADJOINT_MODEL_TYPES = ("mamba", "falcon_mamba")


def check_model(model) -> None:
    """Validate `config.mini_sequence_chunk` and the adjoint-sharding fields; warn once per class if the model
    would ignore them.

    The config validates the flag at construction; this catches a value set afterwards, e.g. by
    `from_pretrained(path, mini_sequence_chunk=...)`, which assigns it to the loaded config.
    """
    config = model.config
    model_type = getattr(config, "model_type", None)
    adjoint = getattr(config, "adjoint_sharding_chunk", None), getattr(config, "adjoint_truncation", None)
    validate_adjoint_sharding(*adjoint)
    if adjoint[0] is not None and model_type not in ADJOINT_MODEL_TYPES:
        logger.warning_once(
            f"{type(model).__name__} (model_type={model_type!r}) has no adjoint-sharding path: "
            f"adjoint_sharding_chunk={adjoint[0]!r} is ignored. It applies to model types {', '.join(ADJOINT_MODEL_TYPES)}."
        )
    value = validate_mini_sequence_chunk(getattr(config, "mini_sequence_chunk", None))
    if value is not None and model_type not in SUPPORTED_MODEL_TYPES + ADJOINT_MODEL_TYPES:
        logger.warning_once(
            f"{type(model).__name__} (model_type={config.model_type!r}) has no mini-sequence path: "
            f"mini_sequence_chunk={value!r} is ignored. It applies to model types "
            f"{', '.join(SUPPORTED_MODEL_TYPES + ADJOINT_MODEL_TYPES)}."
        )
        return
    # A composite model (LLaVA & co) with the flag on its text config: the language model's MLP is
    # split, but the composite's own LM head + loss is upstream's. Say so rather than half-apply it.
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    text_value = getattr(text_config, "mini_sequence_chunk", None)
    if text_config is not config and text_value is not None and model_type not in SUPPORTED_MODEL_TYPES:
        logger.warning_once(
            f"{type(model).__name__} (model_type={model_type!r}): text_config.mini_sequence_chunk={text_value!r} "
            f"splits the language model's MLP into mini-sequences, but {type(model).__name__} computes its LM head "
            "and loss upstream's way (full [batch, seq, vocab] logits): only model types "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} chunk the LM head."
        )

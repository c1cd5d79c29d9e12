"""Checks every model runs at construction (patch 0005 calls `check_model` from `post_init`).

Imported by modeling_utils, so it imports nothing heavy.
"""

from ..utils import logging
from .config import validate_mini_sequence_chunk


logger = logging.get_logger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral", "gemma2")


def check_model(model) -> None:
    """Validate `config.mini_sequence_chunk` and warn once per class if the model would ignore it.

    The config validates the flag at construction; this catches a value set afterwards, e.g. by
    `from_pretrained(path, mini_sequence_chunk=...)`, which assigns it to the loaded config.
    """
    config = model.config
    value = validate_mini_sequence_chunk(getattr(config, "mini_sequence_chunk", None))
    if value is not None and getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        logger.warning_once(
            f"{type(model).__name__} (model_type={config.model_type!r}) has no mini-sequence path: "
            f"mini_sequence_chunk={value!r} is ignored. It applies to model types {', '.join(SUPPORTED_MODEL_TYPES)}."
        )

"""Which models have a mini-sequence path, and the warning for those that do not.

Imported by modeling_utils (patch 0005), so it imports nothing heavy.
"""

from ..utils import logging


logger = logging.get_logger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral", "gemma2")


def warn_if_ignored(model) -> None:
    """Warn once per model class when `mini_sequence_chunk` is set on a config it would ignore."""
    config = model.config
    value = getattr(config, "mini_sequence_chunk", None)
    if value is not None and getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        logger.warning_once(
            f"{type(model).__name__} (model_type={config.model_type!r}) has no mini-sequence path: "
            f"mini_sequence_chunk={value!r} is ignored. It applies to model types {', '.join(SUPPORTED_MODEL_TYPES)}."
        )

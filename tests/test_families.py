"""The registry of families (mst_core/families.py) against what reads it: the README's support matrix, the
tiny test configs, and the checks that derive their model types from it."""

from pathlib import Path

import pytest

import tiny_models
import transformers
from transformers.mst_core import families
from transformers.mst_core import model_checks
from transformers.ulysses import masks as ulysses

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_support_matrix_is_the_registry():
    """The README's table must be `support_matrix()` verbatim: edit families.py, then paste its output."""
    text = README.read_text()
    start = text.index("| family (`model_type`) |")
    end = text.index("\n", text.index("| any other model type |"))
    assert text[start:end] == families.support_matrix(), (
        "README.md's support matrix differs from the registry; replace it with "
        "`python -c 'from transformers.mst_core import families; print(families.support_matrix())'`"
    )


def test_every_family_has_a_tiny_test_config():
    tiny = (set(tiny_models.FAMILIES) | set(tiny_models.NEW_FAMILIES) | set(tiny_models.SSM_FAMILIES)
            | set(tiny_models.RECURRENT_FAMILIES))
    # The multimodal gemma3, gemma4, qwen3_vl, qwen3_vl_moe, qwen3_5 and qwen3_5_moe are built around text tiny configs
    # in tests/test_new_families.py (Qwen3-VL's text stacks have no head of their own: they train inside the composite).
    built_there = ["gemma3", "gemma4", "qwen3_vl_text", "qwen3_vl", "qwen3_vl_moe_text", "qwen3_vl_moe", "qwen3_5",
                   "qwen3_5_moe"]
    assert tiny | set(built_there) == set(families.FAMILIES)
    assert [t for t, family in families.FAMILIES.items() if family.tiny is None] == built_there


@pytest.mark.parametrize("model_type", sorted(families.FAMILIES))
def test_registry_classes_are_the_model_types(model_type):
    """The registry's class names exist and are the classes of that model_type."""
    family = families.FAMILIES[model_type]
    assert getattr(transformers, family.config_class).model_type == model_type
    assert getattr(transformers, family.model_class).config_class is getattr(transformers, family.config_class)


@pytest.mark.parametrize("name", sorted(families.CHECKPOINTS))
def test_planner_checkpoints_build_their_family_config(name):
    model_type, values = families.CHECKPOINTS[name]
    config = getattr(transformers, families.FAMILIES[model_type].config_class)(**values)
    assert config.model_type == model_type and config.hidden_size == values["hidden_size"]


@pytest.mark.parametrize("model_type", sorted(families.FAMILIES))
def test_checks_follow_the_registry(model_type):
    family = families.FAMILIES[model_type]
    applies = {field: model_type in types for field, types in model_checks.FIELD_MODEL_TYPES.items()}
    assert applies["mini_sequence_chunk"] == (family.mini_sequence in ("mlp", "moe", "lm_head"))
    assert applies["streaming_backward_chunk"] == (family.streaming_attention != () or bool(family.streaming_recurrent))
    assert applies["adjoint_sharding_chunk"] == applies["adjoint_truncation"] == family.adjoint
    assert (model_type in ulysses.SUPPORTED_MODEL_TYPES) == family.ulysses


@pytest.mark.parametrize("model_type", sorted(t for t, f in families.FAMILIES.items() if f.mini_sequence in ("mlp", "moe")))
def test_bad_mini_sequence_chunk_refused_at_config_construction(model_type):
    """Every family whose MLP the field chunks declares it on its config (patch 0002): a bad value raises when the
    config is built, not later at the model's construction (patch 0005's check for the other model types)."""
    config_class = getattr(transformers, families.FAMILIES[model_type].config_class)
    assert "mini_sequence_chunk" in config_class.__dataclass_fields__, model_type
    with pytest.raises(ValueError, match=r"mini_sequence_chunk.*None, \"auto\", or a positive int"):
        config_class(mini_sequence_chunk=0)


def test_model_types_filters():
    assert families.model_types(ulysses=True) == (
        "llama", "qwen2", "mistral", "gemma2", "qwen3", "phi3", "olmo2", "gemma3_text", "olmo3", "smollm3",
        "ministral3", "gemma4_text", "mixtral", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "glm4_moe",
        "glm4_moe_lite", "llama4_text", "qwen3_vl_text", "qwen3_vl_moe_text",
    )
    assert "gemma3" not in families.streaming_model_types() and "gpt_oss" in families.streaming_model_types()
    assert set(families.model_types(mini_sequence="moe")) == set(tiny_models.MOE_FAMILIES) | {"qwen3_vl_moe_text"}
    assert families.model_types(adjoint=True, mini_sequence="mlp") == ()

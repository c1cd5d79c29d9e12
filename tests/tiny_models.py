"""The tests' tiny models, from the registry (src/transformers/mst_core/families.py: `TINY`, `TINY_SSM`,
`Family.tiny`), grouped as the tests parametrize them. Importing this imports neither torch nor transformers: the
flag-off probe (tests/flag_off_probe.py) builds these models with pristine upstream too, so the registry (which
imports nothing) is loaded from its file."""

import importlib.util
from pathlib import Path


def _load_registry():
    path = Path(__file__).resolve().parents[1] / "src" / "transformers" / "mst_core" / "families.py"
    spec = importlib.util.spec_from_file_location("_mst_families", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_registry = _load_registry()
REGISTRY, TINY, TINY_SSM, model_types = _registry.FAMILIES, _registry.TINY, _registry.TINY_SSM, _registry.model_types


COMMON = TINY
SSM_COMMON = TINY_SSM


def _entries(model_types):
    return {t: (REGISTRY[t].config_class, REGISTRY[t].model_class, REGISTRY[t].tiny) for t in model_types}


# The four families with every path (streaming, memory, planner tests parametrize over them).
FAMILIES = _entries(("llama", "qwen2", "mistral", "gemma2"))
# The newer families (5.24.0+mst.9): tests/test_new_families.py, tests/test_streaming_families.py.
NEW_FAMILIES = _entries(("qwen3", "phi3", "olmo2", "gemma3_text", "mixtral", "qwen3_moe", "gpt_oss", "qwen3_5_text",
                                "olmo3", "smollm3", "ministral3", "gemma4_text", "qwen3_5_moe_text", "qwen3_next", "olmoe",
                                "deepseek_v2", "deepseek_v3", "glm4_moe", "glm4_moe_lite", "deepseek_v32", "glm_moe_dsa",
                                "llama4_text", "granite", "granitemoe", "granitemoeshared", "jamba",
                                "falcon_h1", "zamba", "zamba2"))
MOE_FAMILIES = tuple(t for t in model_types(mini_sequence="moe") if REGISTRY[t].tiny is not None)  # not Qwen3-VL-MoE's
# MoE families whose head adds no router auxiliary loss (their routers balance by a bias): the router logits are still
# recorded with output_router_logits=True, and reach the routers' gradients through the routing weights.
NO_AUX_LOSS = {"deepseek_v2", "deepseek_v3", "glm4_moe", "glm4_moe_lite", "deepseek_v32", "glm_moe_dsa", "llama4_text",
               "nemotron_h", "lfm2_moe", "kimi_linear"}
# DeepSeek Sparse Attention's indexer (DeepSeek-V3.2, GLM-5) picks keys by a top-k, which has no gradient: upstream's
# own step leaves its weights without one, so tests leave them out of "every parameter trained".
UNTRAINED_UPSTREAM = ".self_attn.indexer."
# State-space families (adjoint sharding).
SSM_FAMILIES = _entries(model_types(adjoint=True))
# Families whose recurrent layers stream through their state (streaming_backward/recurrent.py): state-space sizes.
RECURRENT_FAMILIES = _entries(tuple(t for t, family in REGISTRY.items() if family.streaming_recurrent))


def _entry(family):
    if family in SSM_FAMILIES:
        return SSM_COMMON, SSM_FAMILIES[family]
    if family in NEW_FAMILIES:  # Qwen3.5's and Qwen3-Next's entries are in both: these
        return COMMON, NEW_FAMILIES[family]
    if family in RECURRENT_FAMILIES:  # hybrids with attention layers have attention models' sizes
        return (COMMON if REGISTRY[family].streaming_attention else SSM_COMMON), RECURRENT_FAMILIES[family]
    return COMMON, FAMILIES[family]


def make_config(family, **overrides):
    import transformers

    common, (config_name, _, extra) = _entry(family)
    return getattr(transformers, config_name)(**{**common, **extra, **overrides})


def make_model(family, seed=0, **overrides):
    import torch
    import transformers

    _, (_, model_name, _) = _entry(family)
    torch.manual_seed(seed)
    return getattr(transformers, model_name)(make_config(family, **overrides))


# Families whose layers compute parts in fp32 whatever the model's dtype (`torch.float32`, `.float()` in Gated DeltaNet's
# scan and decay, the norms, the loss): an fp64 step of them is an fp64 step only under `fp64_throughout`.
FP32_INSIDE = tuple(t for t, family in REGISTRY.items() if family.streaming_recurrent == "linear_attn")


def fp64_throughout(family):
    """A context in which `family`'s modeling module and our chunked loss compute in fp64 where they would cast to
    fp32 (`torch.float32` in the module, `Tensor.float()`), so that an fp64 step rounds nowhere at fp32's
    precision: the reference that tells fp32 rounding from an inexact method where the two are close."""
    import contextlib
    import sys
    import types

    import pytest
    import torch
    import transformers
    from transformers.mini_sequence import loss as mini_sequence_loss

    modules = [sys.modules[getattr(transformers, REGISTRY[family].model_class).__module__], mini_sequence_loss]

    class Float64Torch(types.ModuleType):
        def __getattr__(self, name):
            return torch.float64 if name == "float32" else getattr(torch, name)

    @contextlib.contextmanager
    def context():
        with pytest.MonkeyPatch.context() as patch:
            for module in modules:
                patch.setattr(module, "torch", Float64Torch("torch"))
            patch.setattr(torch.Tensor, "float",
                          lambda self: self.to(torch.float64 if self.is_floating_point() else torch.float32))
            yield

    return context()

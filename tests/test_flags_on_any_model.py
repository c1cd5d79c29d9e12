"""Our config fields as a new user sets them: through `from_pretrained` on any model type, on a model whose forward
something else replaced (Liger-Kernel), and with the default `use_cache=True`.

- A field on a model type without its path is validated, kept in the config and ignored with one warning per
  model type (never a `TypeError` from the model's `__init__`); an invalid value raises `ValueError` at load.
- A path of ours that a replaced forward bypasses is named in a warning at the first training forward.
"""

import functools
import logging
import types

import pytest
import torch
import transformers
from test_mini_sequence_models import assert_close
from tiny_models import make_model
from transformers.utils import logging as hf_logging

FIELDS = {  # a valid value of each field (adjoint_truncation needs adjoint_sharding_chunk)
    "mini_sequence_chunk": {"mini_sequence_chunk": "auto"},
    "streaming_backward_chunk": {"streaming_backward_chunk": 8},
    "adjoint_sharding_chunk": {"adjoint_sharding_chunk": 8},
    "adjoint_truncation": {"adjoint_sharding_chunk": 8, "adjoint_truncation": 4},
}
TINY_CONFIGS = {  # model types without some or all of our paths (qwen3: only mini_sequence_chunk's)
    "qwen3": lambda: transformers.Qwen3Config(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8,
    ),
    "gpt2": lambda: transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64),
    "mamba2": lambda: transformers.Mamba2Config(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_heads=2, head_dim=16, state_size=8, n_groups=1,
    ),
    "mamba": lambda: transformers.MambaConfig(vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=1),
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
    ),
}
PATH_MODEL_TYPES = {
    "mini_sequence_chunk": {"llama", "mamba", "qwen3", "mamba2"},  # qwen3: since 5.24.0+mst.9; mamba2: mst.29
    "streaming_backward_chunk": {"llama", "qwen3", "mamba2", "mamba"},  # qwen3: the generic streamed layer; mamba2:
    # recurrent.py; mamba: since 5.24.0+mst.33, its scan from the carried state
    "adjoint_sharding_chunk": {"mamba"},
    "adjoint_truncation": {"mamba"},
}


@pytest.fixture
def warnings_seen(caplog):
    """The warnings logged during the test (transformers' `warning_once` cache cleared first)."""
    hf_logging.warning_once.cache_clear()
    transformers.logging.enable_propagation()
    with caplog.at_level(logging.WARNING):
        yield caplog


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One saved tiny checkpoint per model type."""
    paths = {}
    for model_type, make_config in TINY_CONFIGS.items():
        paths[model_type] = tmp_path_factory.mktemp(model_type)
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(make_config()).save_pretrained(paths[model_type])
    return paths


@pytest.mark.parametrize("field", sorted(FIELDS))
@pytest.mark.parametrize("model_type", sorted(TINY_CONFIGS))
def test_from_pretrained_accepts_every_field_on_every_model_type(saved, model_type, field, warnings_seen):
    model = transformers.AutoModelForCausalLM.from_pretrained(saved[model_type], **FIELDS[field])
    assert getattr(model.config, field) == FIELDS[field][field]
    message = f"model_type={model_type!r} has no {field} path: {field}={FIELDS[field][field]!r} is ignored"
    if model_type in PATH_MODEL_TYPES[field]:
        assert message not in warnings_seen.text
    else:
        # Once, although `*Model` and `*ForCausalLM` both check it.
        assert warnings_seen.text.count(message) == 1, warnings_seen.text
    # Saved with the config and read back like any field.
    model.save_pretrained(saved[model_type] / f"with-{field}")
    config = transformers.AutoConfig.from_pretrained(saved[model_type] / f"with-{field}")
    assert getattr(config, field) == FIELDS[field][field]


@pytest.mark.parametrize(
    "bad",
    [{"mini_sequence_chunk": 0}, {"streaming_backward_chunk": 0}, {"adjoint_sharding_chunk": -1},
     {"adjoint_truncation": 4}, {"streaming_backward_chunk": 2.5}],
    ids=lambda bad: ",".join(f"{k}={v}" for k, v in bad.items()),
)
@pytest.mark.parametrize("model_type", sorted(TINY_CONFIGS))
def test_invalid_value_raises_at_load_on_every_model_type(saved, model_type, bad, monkeypatch):
    loaded = []
    monkeypatch.setattr(transformers.PreTrainedModel, "_load_pretrained_model", lambda *a, **k: loaded.append(1))
    field = next(iter(bad))
    with pytest.raises(ValueError, match=f"`{field}`"):
        transformers.AutoModelForCausalLM.from_pretrained(saved[model_type], **bad)
    assert not loaded, "weights were loaded before the bad value was refused"


def test_streaming_on_a_model_type_without_the_path_trains_as_upstream(saved, warnings_seen):
    """It was a ValueError at the first training forward, after a warning that said the field is ignored."""
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    losses = []
    for flags in ({}, {"streaming_backward_chunk": 4, "mini_sequence_chunk": 4}):
        model = transformers.AutoModelForCausalLM.from_pretrained(saved["gpt2"], **flags).train()
        torch.manual_seed(0)  # GPT-2's dropout
        losses.append(model(input_ids=ids, labels=ids).loss)
    assert torch.equal(losses[0], losses[1])


# ----------------------------------------------------------------------------- replaced forwards (Liger-Kernel)


def foreign_module():
    """A module outside transformers holding a replacement MLP and causal-LM forward, as Liger-Kernel's do."""
    module = types.ModuleType("liger_kernel_standin")
    exec(
        "import torch\n"
        "class SwiGLUMLP(torch.nn.Module):\n"
        "    def forward(self, x):\n"
        "        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))\n"
        "def causal_lm_forward(self, input_ids=None, labels=None, **kwargs):\n"
        "    hidden = self.model(input_ids=input_ids, **kwargs).last_hidden_state\n"
        "    logits = self.lm_head(hidden).float()\n"
        "    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())\n"
        "    return transformers_output(loss=loss, logits=logits)\n",
        module.__dict__,
    )
    module.transformers_output = transformers.modeling_outputs.CausalLMOutputWithPast
    return module


def train_twice(model):
    ids = torch.randint(1, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    model.train()
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()


def test_liger_style_instance_patch_is_reported_once(warnings_seen):
    liger = foreign_module()
    model = make_model("llama", mini_sequence_chunk=4, streaming_backward_chunk=4)
    for layer in model.model.layers:  # as Liger's `_patch_swiglu_module`
        layer.mlp.__dict__["forward"] = liger.SwiGLUMLP.forward.__get__(layer.mlp)
    model.forward = types.MethodType(liger.causal_lm_forward, model)  # as `apply_liger_kernel_to_llama(model=...)`
    train_twice(model)
    text = warnings_seen.text
    assert text.count("mini_sequence_chunk: the chunked LM head + loss (LlamaForCausalLM.forward is "
                      "liger_kernel_standin.causal_lm_forward)") == 1
    assert text.count("mini_sequence_chunk: the mini-sequence MLP (LlamaMLP.forward is "
                      "liger_kernel_standin.SwiGLUMLP.forward)") == 1
    assert "streaming_backward_chunk" not in text  # the decoder layers are still ours
    assert not model._forward_pre_hooks and not model.model._forward_pre_hooks  # the check ran once, then left


def test_liger_style_class_patch_is_reported(monkeypatch, warnings_seen):
    liger = foreign_module()
    from transformers.models.llama import modeling_llama

    class LigerLikeMLP(liger.SwiGLUMLP):  # as `modeling_llama.LlamaMLP = LigerSwiGLUMLP` before the model is built
        def __init__(self, config):
            super().__init__()
            self.gate_proj = torch.nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
            self.up_proj = torch.nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
            self.down_proj = torch.nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    monkeypatch.setattr(modeling_llama, "LlamaMLP", LigerLikeMLP)
    train_twice(make_model("llama", mini_sequence_chunk=4))
    assert "the mini-sequence MLP (LigerLikeMLP.forward is liger_kernel_standin.SwiGLUMLP.forward)" in warnings_seen.text


def test_wrappers_that_call_the_original_forward_are_not_reported(warnings_seen):
    model = make_model("llama", mini_sequence_chunk=4)
    for layer in model.model.layers:  # as accelerate's `add_hook_to_module`
        original = layer.mlp.forward
        layer.mlp._old_forward = original
        layer.mlp.forward = functools.update_wrapper(functools.partial(lambda m, *a, **k: m._old_forward(*a, **k), layer.mlp), original)
    train_twice(model)
    assert "does not run" not in warnings_seen.text


def test_no_check_hook_with_the_fields_unset():
    model = make_model("llama")
    assert not model._forward_pre_hooks and not model.model._forward_pre_hooks


# ----------------------------------------------------------------------------- streaming and use_cache


def test_streaming_training_forward_with_default_use_cache(warnings_seen):
    """As under upstream's gradient checkpointing, which streaming replaces: the layers neither read nor fill the
    cache the model makes for `use_cache=True`, and (unlike checkpointing) nothing is logged for the default."""
    ids = torch.randint(1, 128, (2, 16), generator=torch.Generator().manual_seed(4))
    reference = make_model("llama").train()(input_ids=ids, labels=ids)
    model = make_model("llama", streaming_backward_chunk=5).train()
    assert model.config.use_cache
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    assert_close(out.loss, reference.loss, what="loss")
    assert out.cache is not None and out.cache.get_seq_length() == 0
    assert warnings_seen.text == ""


def test_streaming_refuses_a_filled_cache():
    ids = torch.randint(1, 128, (1, 16), generator=torch.Generator().manual_seed(6))
    model = make_model("llama", streaming_backward_chunk=5)
    with torch.no_grad():
        cache = model.eval()(input_ids=ids[:, :8], use_cache=True).cache
    model.train()
    with pytest.raises(ValueError, match="holds 8 cached tokens"):
        model(input_ids=ids[:, 8:], labels=ids[:, 8:], cache=cache)


def test_trl_fused_lm_head_is_not_reported(warnings_seen):
    """TRL's SFT/DPO trainers bind their own chunked LM head, wrapping the original forward (`functools.wraps`);
    the MLPs stay ours and one chunked head runs, not two (docs/mini-sequence.md, "TRL, PEFT, QLoRA"): nothing to report."""
    from trl.trainer.utils import add_fused_lm_head

    model = make_model("llama", mini_sequence_chunk=4)
    add_fused_lm_head(model)
    ids = torch.randint(1, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    model.train()
    out = model(input_ids=ids, labels=ids, fused_lm_head=True)
    assert model.forward.__func__ is not type(model).forward  # replaced
    out.log_probs.sum().backward()
    assert "does not run" not in warnings_seen.text

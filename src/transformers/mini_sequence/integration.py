"""What the patched model files call: each patched forward adds a line or two that call one of these.

- `mlp_forward(mlp, x)`: from `LlamaMLP.forward` & co; the MLP by mini-sequences, or None (run upstream's body).
- `final_norm(model, x)`: from `LlamaModel.forward` & co, the final norm (by mini-sequences when set).
- `computes_loss(model, labels)` / `causal_lm_output(...)`: from `*ForCausalLM.forward`, to compute
  the LM head + causal-LM loss chunk by chunk instead of materializing [B, S, V] logits
  (`causal_lm_loss(...)` for the MoE heads, which add their auxiliary loss to it).
- `mlp_then_norm(mlp, norm, x)`: from the decoder layers with a post-feedforward norm (Gemma-2, Gemma-3, OLMo-2).
- `moe_forward(block, x)`: from the sparse MoE blocks' `forward` (Mixtral, Qwen3-MoE, GPT-OSS), as `mlp_forward`.
"""

from ..mst_core.chunks import inside_streamed_chunk, policy_device_type
from ..mst_core.model_checks import text_config
from ..loss.loss_utils import ForCausalLMLoss
from ..modeling_outputs import CausalLMOutputWithPast
from ..utils import logging
from .config import lm_head_chunk_size, mlp_chunk_size
from .loss import mini_sequence_causal_lm_loss
from .mlp import mini_sequence_mlp, mini_sequence_mlp_then_norm, mini_sequence_norm
from .moe import mini_sequence_moe


logger = logging.get_logger(__name__)

# causal_lm_output's default softcap: the one the model's own config holds (`_model_softcapping`).
_MODEL_CONFIG = object()


def enabled(config) -> bool:
    """Whether `config` asks for mini-sequences. `getattr`: MLPs and heads are also built from
    configs that lack the field (draft heads, derived models), which then run upstream's path."""
    return getattr(config, "mini_sequence_chunk", None) is not None


def mlp_forward(mlp, hidden_states):
    """`mlp` on `hidden_states` one mini-sequence of tokens at a time, or None: then the caller runs its own
    upstream body. The patched forwards start with

        if (mini_sequence_out := mini_sequence.mlp_forward(self, x)) is not None:
            return mini_sequence_out

    None when the flag is unset, inside one streamed query chunk (mst_core/chunks.py: the chunk bounds the MLP's
    working set already) or when `hidden_states` holds at most one mini-sequence along its token axis (-2),
    which includes each chunk that the chunked path passes back to the module's own `forward`
    (mlp.py's `module_forward`): the upstream body then runs per chunk, whatever it computes (a fused
    gate_up_proj, GELU, a sparse MoE block), and nothing of it is spelled out here."""
    config = mlp.config
    if not enabled(config) or inside_streamed_chunk():
        return None
    chunk_size = mlp_chunk_size(config.mini_sequence_chunk, config.hidden_size, policy_device_type(hidden_states))
    if hidden_states.shape[-2] <= chunk_size:
        return None
    return mini_sequence_mlp(mlp, hidden_states, chunk_size)


def mlp_then_norm(mlp, norm, hidden_states):
    """`norm(mlp(hidden_states))`, for the decoder layers that normalize the MLP's output (Gemma-2, Gemma-3, OLMo-2:
    `post_feedforward_layernorm`), patched in for upstream's two lines `hidden_states = self.mlp(hidden_states)`,
    `hidden_states = self.post_feedforward_layernorm(hidden_states)`, which is what runs when the flag is unset.
    With `mini_sequence_chunk` set the two run together one mini-sequence at a time (mlp.py's
    `mini_sequence_mlp_then_norm`: under checkpointing the MLP then runs twice a step, not three times)."""
    config = mlp.config
    if not enabled(config) or inside_streamed_chunk():
        return norm(mlp(hidden_states))
    chunk_size = mlp_chunk_size(config.mini_sequence_chunk, config.hidden_size, policy_device_type(hidden_states))
    return mini_sequence_mlp_then_norm(mlp, norm, hidden_states, chunk_size)


def moe_forward(block, hidden_states, tokens_flattened=False, beside=None):
    """A sparse MoE block (Mixtral, Qwen3-MoE, GPT-OSS) on `hidden_states` one mini-sequence of tokens at a time,
    or None (run upstream's body), as `mlp_forward`; moe.py records the router logits once, whole. Router jitter
    noise in training draws a different noise per chunk than over the whole sequence, so such a block runs unsplit.
    `tokens_flattened`: the block returns its output as [batch * S, d], token-major (Llama-4's), not [..., S, d].
    `beside`: an MLP on the same input whose output is added to the block's, run in the same chunks (`moe_plus_mlp`)."""
    config = block.config
    if not enabled(config) or inside_streamed_chunk():
        return None
    chunk_size = mlp_chunk_size(config.mini_sequence_chunk, config.hidden_size, policy_device_type(hidden_states))
    if hidden_states.shape[-2] <= chunk_size:
        return None
    if block.training and getattr(config, "router_jitter_noise", 0.0):
        logger.warning_once(
            f"{type(block).__name__}: router_jitter_noise={config.router_jitter_noise} in training; the MoE blocks "
            "run unsplit (chunks would draw other noise than the whole sequence). The rest stays chunked."
        )
        return None
    return mini_sequence_moe(block, hidden_states, chunk_size, tokens_flattened, beside=beside)


def moe_plus_mlp(block, mlp, hidden_states):
    """`block(hidden_states) + mlp(hidden_states)`: a MoE block and a shared MLP beside it on the same input (the
    decoder layers of GraniteMoE-shared and Granite-4.0-H; `mlp` None: the block alone), patched in for upstream's
    lines, which is what runs when the flag is unset. With `mini_sequence_chunk` set both run one mini-sequence at a
    time through one Function (`moe_forward(..., beside=mlp)`): under checkpointing each token goes through the router
    twice a step, not three times."""
    if mlp is None:
        return block(hidden_states)
    if (mini_sequence_out := moe_forward(block, hidden_states, beside=mlp)) is not None:
        return mini_sequence_out
    return block(hidden_states) + mlp(hidden_states)


def final_norm(model, hidden_states, norm=None):
    """`norm(hidden_states)`, the model's final norm (`model.norm` unless given: Bamba's `final_layernorm`, Nemotron-H's
    `norm_f`, LFM2's `embedding_norm`); with `mini_sequence_chunk` set, one mini-sequence at a time (mlp.py's
    `mini_sequence_norm`: no fp32 copies of the whole sequence in its backward)."""
    config = model.config
    norm = model.norm if norm is None else norm
    if not enabled(config):
        return norm(hidden_states)
    chunk_size = mlp_chunk_size(config.mini_sequence_chunk, config.hidden_size, policy_device_type(hidden_states))
    return mini_sequence_norm(norm, hidden_states, chunk_size)


def computes_loss(model, labels) -> bool:
    """Whether `model.forward` should compute its loss chunk-wise (and return `logits=None`).

    Only in training mode with labels: in eval and generation the logits are what callers want
    (metrics, sampling), so the upstream path runs. A model whose loss function was replaced
    keeps the upstream path too, with a warning, since the chunked loss is ForCausalLMLoss's.
    So does a model adding a z-loss (Bamba's `z_loss_coefficient`), warned likewise, and a batch that would be one
    LM-head chunk: splitting nothing saves nothing, and the
    chunked path's fp32 [V, d] gradient buffer would put its peak above upstream's.
    """
    config = text_config(model.config)
    if not enabled(config) or labels is None or not model.training:
        return False
    num_tokens = labels.numel()
    if lm_head_chunk_size(config.mini_sequence_chunk, config.hidden_size, config.vocab_size, num_tokens) >= num_tokens:
        return False
    if getattr(model, "z_loss_coefficient", 0):  # Bamba's: a term over the whole [B, S, V] logits
        logger.warning_once(
            f"{type(model).__name__}: mini_sequence_chunk is set but z_loss_coefficient={model.z_loss_coefficient} "
            "adds a z-loss over the whole logits, which the chunked loss does not compute; the LM head and loss run "
            "unsplit. Set z_loss_coefficient=0 to chunk them."
        )
        return False
    if model.loss_function is not ForCausalLMLoss:
        logger.warning_once(
            f"{type(model).__name__}: mini_sequence_chunk is set but the model's loss function is "
            f"{getattr(model.loss_function, '__name__', model.loss_function)!r}, not ForCausalLMLoss; "
            "the LM head and loss run unsplit (the MLP is still split)."
        )
        return False
    return True


def causal_lm_loss(model, hidden_states, labels, *, logits_scaling=None, **kwargs):
    """The chunked loss of `causal_lm_output` where `computes_loss` holds, else None: for the MoE heads (Mixtral,
    Qwen3-MoE, GPT-OSS), whose upstream lines then add the router's auxiliary loss to it and build their own output.
    Patched as `loss = mini_sequence.causal_lm_loss(...)`, `logits = self.lm_head(h) if loss is None else None`,
    `if labels is not None and logits is not None:` (upstream's loss). `logits_scaling`: as `causal_lm_output`'s."""
    if not computes_loss(model, labels):
        return None
    hidden_states = _scaled(model, hidden_states, logits_scaling)
    return _chunked_loss(model, hidden_states, labels, _model_softcapping(model), **kwargs)


def _scaled(model, hidden_states, logits_scaling, logits_multiplier=None):
    """The hidden states whose logits are the head's logits divided by `logits_scaling` (Granite's heads) or times
    `logits_multiplier` (Falcon-H1's): the same for a head without bias, bit for bit where the scale is a power of two,
    else to one rounding of the scaling."""
    if logits_scaling is None and logits_multiplier is None:
        return hidden_states
    if getattr(model.lm_head, "bias", None) is not None:
        scale = f"logits_scaling={logits_scaling}" if logits_multiplier is None else f"times {logits_multiplier}"
        raise ValueError(
            f"mini_sequence_chunk: {type(model).__name__}'s lm_head has a bias, so its logits scaled by {scale} are "
            "not those of the hidden states so scaled. Unset the field."
        )
    return hidden_states / logits_scaling if logits_multiplier is None else hidden_states * logits_multiplier


def _model_softcapping(model):
    """The logit softcap that upstream's head applies: the model's own config's. Gemma-2/3's *ForCausalLM cap their
    logits; Gemma3ForConditionalGeneration does not (upstream applies none there, and its config has no such field);
    Gemma4ForConditionalGeneration caps by its text config's, which its patched line passes explicitly."""
    return getattr(model.config, "final_logit_softcapping", None)


def _chunked_loss(model, hidden_states, labels, final_logit_softcapping, **kwargs):
    config = text_config(model.config)
    num_tokens = hidden_states.shape[0] * hidden_states.shape[1]
    return mini_sequence_causal_lm_loss(
        hidden_states,
        model.lm_head,
        labels,
        chunk_size=lm_head_chunk_size(config.mini_sequence_chunk, config.hidden_size, config.vocab_size, num_tokens),
        vocab_size=config.vocab_size,
        num_items_in_batch=kwargs.get("num_items_in_batch"),
        ignore_index=kwargs.get("ignore_index", -100),
        shift_labels=kwargs.get("shift_labels"),
        final_logit_softcapping=final_logit_softcapping,
    )


def causal_lm_output(model, hidden_states, labels, outputs, output_class=CausalLMOutputWithPast, *,
                     final_logit_softcapping=_MODEL_CONFIG, logits_scaling=None, logits_multiplier=None, **kwargs):
    """Loss of `model.lm_head(hidden_states)` against `labels`, chunk by chunk; `logits` is None.

    Same semantics as upstream's ForCausalLMLoss (label shift, ignore_index, shift_labels,
    num_items_in_batch) and, for Gemma-2/3/4, the logit softcap applied per chunk: `final_logit_softcapping`, by
    default the model config's (`_model_softcapping`); for Granite's heads, which divide the logits by
    `logits_scaling`, the hidden states so divided, and for Falcon-H1's, which multiply them by `logits_multiplier`,
    so multiplied (`_scaled`). The result
    is `output_class` with the base model's other outputs (its `cache`,
    hidden_states, attentions); a tuple `(loss, None, *outputs[1:])` when the base model returned a
    tuple (Mamba with `return_dict=False`), where upstream puts the logits second.
    """
    if final_logit_softcapping is _MODEL_CONFIG:
        final_logit_softcapping = _model_softcapping(model)
    hidden_states = _scaled(model, hidden_states, logits_scaling, logits_multiplier)
    loss = _chunked_loss(model, hidden_states, labels, final_logit_softcapping, **kwargs)
    if isinstance(outputs, tuple):
        return (loss, None, *outputs[1:])
    return output_class(loss=loss, logits=None, **{k: v for k, v in outputs.items() if k != "last_hidden_state"})

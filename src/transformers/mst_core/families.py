"""The model families transformers-mst has a path for: one entry per `model_type`, and the full-size checkpoints
the planner knows by name.

Read by the model checks (`model_checks.py`: which field applies where), the generic streamed layer (which families it
streams), Ulysses (whose masks it can rebuild), the planner (`CHECKPOINTS`), the bench (class names), the tests
(`tests/tiny_models.py`: the tiny configs) and the README's support matrix (`support_matrix()`, compared with
README.md by tests/test_families.py). Imports nothing: model_checks.py, which reads it, is imported by configuration_utils.
"""

from typing import NamedTuple


class Family(NamedTuple):
    name: str  # as the README names it
    config_class: str  # transformers' configuration class
    model_class: str  # the model class trained with a language-modelling loss (`*ForCausalLM`, or the composite's)
    # What mini_sequence_chunk chunks: "mlp" (MLP, final norm, LM head + loss), "moe" (the same with MoE blocks by
    # token chunks), "lm_head" (final norm and LM head + loss only: state-space models), "text_config" (a composite
    # whose text config carries the field), or None.
    mini_sequence: str | None
    # Attention implementations streaming_backward_chunk streams this family's decoder layers with (tested: the
    # layer's own forward per query chunk, streaming_backward/); () where the field is not supported.
    streaming_attention: tuple = ()
    no_streaming: str = "ignored"  # the README's word where the family does not stream
    # The attribute of a recurrent decoder layer's mixer (a state-space or linear-attention layer meeting upstream's
    # cache at its conv/recurrent state): streaming_backward_chunk streams the layer through its state
    # (streaming_backward/recurrent.py). None: no recurrent layer streams.
    streaming_recurrent: str | None = None
    # Decoder layer classes whose attention and recurrent mixer sit deeper (Zamba2's hybrid layers: a shared attention
    # block, then a Mamba2 decoder layer): class name -> (the attention module's path, the mixer's path, the argument
    # carrying the attention's mask), read by streaming_backward/parts.py. Such a layer streams as Falcon-H1's does (by
    # query chunks, the mixer's states carried); a decoder layer inside it runs as part of it.
    streaming_nested: dict | None = None
    # How many values the family's decoder layer returns in a tuple (Bamba's: its hidden states and attention weights;
    # Falcon-H1's: its hidden states alone), which its model unpacks; a streamed layer returns as many
    # (streaming_backward/parts.py `returned`). None: the hidden states, not in a tuple.
    streaming_layer_returns: int | None = None
    # (config attribute, what it does): a config where that attribute is set (non-zero) is not streamed (warned at
    # construction), e.g. Gemma-4's K/V shared across layers. None: every config of the family streams.
    streaming_unless: tuple | None = None
    # Ulysses rebuilds this family's whole-sequence masks exactly, and the rest of its layers works token by token
    # (MoE routing; rotary embeddings and query scaling from each rank's position_ids); tests/test_ulysses.py runs each.
    ulysses: bool = False
    adjoint: bool = False  # adjoint_sharding_chunk / adjoint_truncation
    # The tests' tiny model: these values over TINY (TINY_SSM for state-space models); None where the tests build it
    # from another family's (Gemma-3 multimodal around gemma3_text's).
    tiny: dict | None = None


_ATTENTION = ("sdpa", "eager", "flash_attention_2")
# Routed experts (DeepSeek-V2/V3's, GLM-4.5's): 4 experts in 2 groups, each token's top-2 from its best group, a shared
# expert beside them.
_TINY_EXPERTS = {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "n_shared_experts": 1,
                 "n_group": 2, "topk_group": 1}
# Multi-head Latent Attention's sizes (DeepSeek-V2/V3, GLM-4.7-Flash): every head its own keys (no GQA groups).
_TINY_LATENT = {"num_key_value_heads": 4, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
                "v_head_dim": 8}
# Granite's muP multipliers, every one away from 1, and a logit scale that is not a power of two.
_TINY_GRANITE = {"embedding_multiplier": 2.0, "residual_multiplier": 0.5, "attention_multiplier": 0.3,
                 "logits_scaling": 3.0}
# Gated DeltaNet linear attention (Qwen3.5, Qwen3-Next): one linear-attention and one full-attention layer; with MoE
# blocks (Qwen3-Next, Qwen3.5-MoE) of 4 experts, top-2, a gated shared expert, the aux loss weighted 1.0.
_TINY_LINEAR = {"head_dim": 8, "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_num_key_heads": 2,
                "linear_num_value_heads": 4, "layer_types": ["linear_attention", "full_attention"]}
_TINY_LINEAR_MOE = {**_TINY_LINEAR, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                    "shared_expert_intermediate_size": 16, "router_aux_loss_coef": 1.0}
# DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): a query LoRA, layer 0 dense, and an indexer keeping 8 keys per query.
_TINY_INDEXER = {"q_lora_rank": 16, "mlp_layer_types": ["dense", "sparse"], "index_topk": 8, "index_head_dim": 8,
                 "index_n_heads": 2}

FAMILIES = {
    "llama": Family("Llama", "LlamaConfig", "LlamaForCausalLM", "mlp", _ATTENTION, ulysses=True, tiny={}),
    "qwen2": Family("Qwen2", "Qwen2Config", "Qwen2ForCausalLM", "mlp", _ATTENTION, ulysses=True, tiny={}),
    "mistral": Family("Mistral", "MistralConfig", "MistralForCausalLM", "mlp", _ATTENTION, ulysses=True, tiny={}),
    # Gemma-2's softcapped attention has no SDPA path upstream.
    "gemma2": Family("Gemma-2", "Gemma2Config", "Gemma2ForCausalLM", "mlp", ("eager", "flash_attention_2"),
                     ulysses=True, tiny={"head_dim": 8, "final_logit_softcapping": 30.0}),
    "qwen3": Family("Qwen3", "Qwen3Config", "Qwen3ForCausalLM", "mlp", _ATTENTION, ulysses=True, tiny={"head_dim": 8}),
    "phi3": Family("Phi-3", "Phi3Config", "Phi3ForCausalLM", "mlp", _ATTENTION, ulysses=True,
                   tiny={"bos_token_id": 1, "eos_token_id": 2}),
    "olmo2": Family("OLMo-2", "Olmo2Config", "Olmo2ForCausalLM", "mlp", _ATTENTION, ulysses=True,
                    tiny={"eos_token_id": 2}),
    # Tiny: a sliding window (8) shorter than the test sequences, on one layer of two; a softcap (2.0) that bends the
    # tiny logits (at 30 a softcap left out of the chunked loss moved the gradients by only ~3e-5).
    "gemma3_text": Family("Gemma-3 text", "Gemma3TextConfig", "Gemma3ForCausalLM", "mlp", _ATTENTION, ulysses=True,
                          tiny={"head_dim": 8, "final_logit_softcapping": 2.0, "sliding_window": 8,
                                "layer_types": ["sliding_attention", "full_attention"]}),
    # OLMo-3: OLMo-2's post-norm layers with sliding-window layers (3 to 1). Tiny: a window (8) shorter than the test
    # sequences on one layer of two.
    "olmo3": Family("OLMo-3", "Olmo3Config", "Olmo3ForCausalLM", "mlp", _ATTENTION, ulysses=True,
                    tiny={"eos_token_id": 2, "sliding_window": 8,
                          "layer_types": ["sliding_attention", "full_attention"]}),
    # SmolLM3: Llama layers, some without rotary embeddings (NoPE). Tiny: layer 1 of 2 is NoPE.
    "smollm3": Family("SmolLM3", "SmolLM3Config", "SmolLM3ForCausalLM", "mlp", _ATTENTION, ulysses=True,
                      tiny={"bos_token_id": 1, "eos_token_id": 2, "no_rope_layers": [1, 0]}),
    # Ministral-3: Mistral layers whose queries are scaled by position (Llama-4's attention scaling). Tiny: the
    # scaling steps every 8 positions, so it varies along the test sequences (the released step is 16384).
    "ministral3": Family("Ministral-3", "Ministral3Config", "Ministral3ForCausalLM", "mlp", _ATTENTION, ulysses=True,
                         tiny={"rope_parameters": {"type": "yarn", "rope_theta": 1000000.0, "factor": 16.0,
                                                   "original_max_position_embeddings": 8, "beta_fast": 32.0,
                                                   "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0,
                                                   "llama_4_scaling_beta": 0.1}}),
    # Granite 3.x (`granite`): Llama's layers with muP multipliers (embeddings, residuals, attention scale) and a head
    # dividing its logits by `logits_scaling`; the chunked loss takes the hidden states so divided (patch 0004: the
    # head has no bias, so the logits are the same, to one rounding of the hidden states where the scale is not a
    # power of two). Tiny: every multiplier away from 1, a scale of 3.
    "granite": Family("Granite", "GraniteConfig", "GraniteForCausalLM", "mlp", _ATTENTION,
                      tiny=_TINY_GRANITE),
    # GraniteMoE (`granitemoe`, IBM's PowerMoE and Granite 3.x MoE) and GraniteMoE-shared (`granitemoeshared`: a shared
    # MLP beside the experts): Granite's layers with MoE blocks recording their router logits, the aux loss in the
    # head. MoE blocks (and the shared MLP), final norm and LM head + loss by mini-sequences (the head as Granite's,
    # with the aux loss added by upstream's lines). Tiny: Granite's multipliers, 4 experts of 64, top-2, the aux loss
    # weighted 1.0.
    "granitemoe": Family("GraniteMoE", "GraniteMoeConfig", "GraniteMoeForCausalLM", "moe", _ATTENTION,
                         tiny={**_TINY_GRANITE, "num_local_experts": 4, "num_experts_per_tok": 2,
                               "router_aux_loss_coef": 1.0}),
    "granitemoeshared": Family("GraniteMoE-shared", "GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM", "moe",
                               _ATTENTION, tiny={**_TINY_GRANITE, "num_local_experts": 4, "num_experts_per_tok": 2,
                                                 "router_aux_loss_coef": 1.0, "shared_intermediate_size": 64}),
    # Gemma-4 text (`Gemma4ForCausalLM`): Gemma-3's layers plus per-layer input embeddings, K/V shared across the last
    # layers (E2B, E4B), and on 26B-A4B a MoE block beside the MLP (not chunked). Streamed: a layer's per-layer input
    # is a row input of the streamed layer (its gradient summed chunk by chunk, streaming_backward/layer.py). Not where
    # layers share K/V (`num_kv_shared_layers` > 0): a layer reading K/V another layer stored needs them whole, with
    # their graph. Tiny: Gemma-3 text's, with per-layer inputs of 8 (their vocabulary covers the tests' larger ones),
    # full-attention heads (`global_head_dim`) of 8 and no K/V shared (upstream's default).
    "gemma4_text": Family("Gemma-4 text", "Gemma4TextConfig", "Gemma4ForCausalLM", "mlp", _ATTENTION, ulysses=True,
                          streaming_unless=("num_kv_shared_layers", "K/V shared across layers"),
                          tiny={"head_dim": 8, "global_head_dim": 8, "final_logit_softcapping": 2.0,
                                "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
                                "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 4096}),
    # Tiny MoE: 4 experts, top-2; the auxiliary loss weighted 1.0 so that its gradient counts in the comparisons.
    "mixtral": Family("Mixtral", "MixtralConfig", "MixtralForCausalLM", "moe", _ATTENTION, ulysses=True,
                      tiny={"num_local_experts": 4, "num_experts_per_tok": 2, "router_aux_loss_coef": 1.0}),
    # Tiny: layer 0 dense (Qwen3MoeMLP), layer 1 sparse.
    "qwen3_moe": Family("Qwen3-MoE", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", "moe", _ATTENTION, ulysses=True,
                        tiny={"head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                              "norm_topk_prob": True, "mlp_only_layers": [0], "router_aux_loss_coef": 1.0}),
    # OLMoE: Mixtral-style routed experts (64, 8 per token; no shared expert) with the auxiliary loss; OLMo's q/k norms.
    # Tiny: 4 experts, top-2, the aux loss weighted 1.0.
    "olmoe": Family("OLMoE", "OlmoeConfig", "OlmoeForCausalLM", "moe", _ATTENTION, ulysses=True,
                    tiny={"eos_token_id": 2, "num_experts": 4, "num_experts_per_tok": 2, "router_aux_loss_coef": 1.0}),
    # DeepSeek-V2 and -V3: Multi-head Latent Attention (the cache holds the compressed latents, which the streamed
    # layer meets at its Cache seam like any K/V), routed experts beside shared ones, the first layers dense; no
    # auxiliary loss in the head. Tiny: layer 0 dense, layer 1 with 4 routed experts (top-2) in 2 groups; V2 without a
    # query LoRA (V2-Lite), V3 with one.
    "deepseek_v2": Family("DeepSeek-V2", "DeepseekV2Config", "DeepseekV2ForCausalLM", "moe", _ATTENTION, ulysses=True,
                          tiny={**_TINY_EXPERTS, **_TINY_LATENT, "first_k_dense_replace": 1, "q_lora_rank": None,
                                "topk_method": "group_limited_greedy"}),
    "deepseek_v3": Family("DeepSeek-V3", "DeepseekV3Config", "DeepseekV3ForCausalLM", "moe", _ATTENTION, ulysses=True,
                          tiny={**_TINY_EXPERTS, **_TINY_LATENT, "first_k_dense_replace": 1, "q_lora_rank": 16,
                                "routed_scaling_factor": 2.5}),
    # GLM-4.5/4.6/4.7 (`glm4_moe`): DeepSeek-V3's MoE with grouped-query attention, partial RoPE and q/k norms.
    # Tiny: DeepSeek-V3's experts, q/k norms on.
    "glm4_moe": Family("GLM-4.5", "Glm4MoeConfig", "Glm4MoeForCausalLM", "moe", _ATTENTION, ulysses=True,
                       tiny={**_TINY_EXPERTS, "first_k_dense_replace": 1, "use_qk_norm": True}),
    # GLM-4.7-Flash (`glm4_moe_lite`): GLM-4.5's MoE with DeepSeek-V3's latent attention.
    "glm4_moe_lite": Family("GLM-4.7-Flash", "Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", "moe", _ATTENTION, ulysses=True,
                            tiny={**_TINY_EXPERTS, **_TINY_LATENT, "q_lora_rank": 16,
                                  "mlp_layer_types": ["dense", "sparse"]}),
    # DeepSeek-V3.2 and GLM-5 (`glm_moe_dsa`): DeepSeek-V3's and GLM-4.7-Flash's layers with DeepSeek Sparse Attention,
    # an indexer that picks each query's top-k keys. Not streamed: over a chunk's keys `torch.topk` may keep another of
    # the keys tied at the k-th place than over the whole row (docs/limits.md), so a streamed chunk would not attend
    # to the keys upstream attends to (and the indexer's own keys live in the cache, `update_indexer`). Its top-k is
    # not differentiable, so its weights get no gradient, upstream's neither. Tiny: GLM-4.7-Flash's, with an indexer
    # keeping 8 keys per query (fewer than the test sequences) over 2 heads of 8.
    "deepseek_v32": Family("DeepSeek-V3.2", "DeepseekV32Config", "DeepseekV32ForCausalLM", "moe",
                           no_streaming="ignored (warned): sparse attention's indexer",
                           tiny={**_TINY_EXPERTS, **_TINY_LATENT, **_TINY_INDEXER}),
    "glm_moe_dsa": Family("GLM-5", "GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", "moe",
                          no_streaming="ignored (warned): sparse attention's indexer",
                          tiny={**_TINY_EXPERTS, **_TINY_LATENT, **_TINY_INDEXER}),
    # Llama-4 text (`Llama4ForCausalLM`, what AutoModelForCausalLM builds from a `llama4` checkpoint): MoE blocks
    # whose experts see every token scaled by its router score (top-1 in the releases) beside a shared expert, dense
    # MLPs on interleaved layers (Maverick), chunked attention on the rotary layers and NoPE layers whose queries are
    # scaled by position; no aux loss in the head. Streamed with sdpa and eager: a query chunk reads upstream's
    # chunked mask, sliced, and its NoPE layer numbers the chunk's queries from the cache's `get_seq_length`
    # (streaming_backward/cache.py); upstream's FlashAttention refuses chunked attention over more keys than a chunk.
    # Tiny: layer 0 dense with chunked attention (chunks of 8), layer 1 MoE (4 experts of 16) and NoPE, its query
    # scale stepping every 4 positions (the released step is 8192).
    "llama4_text": Family("Llama-4 text", "Llama4TextConfig", "Llama4ForCausalLM", "moe", ("sdpa", "eager"), ulysses=True,
                          tiny={"head_dim": 8, "num_local_experts": 4, "intermediate_size": 16,
                                "intermediate_size_mlp": 64, "interleave_moe_layer_step": 2,
                                "no_rope_layer_interval": 2, "attention_chunk_size": 8, "floor_scale": 4,
                                "bos_token_id": 1, "eos_token_id": 2}),
    # GPT-OSS: sinks; upstream has no SDPA path, and its FlashAttention needs a kernel with sinks (not flash-attn).
    # Tiny: alternating sliding (window 8) and full attention layers.
    "gpt_oss": Family("GPT-OSS", "GptOssConfig", "GptOssForCausalLM", "moe", ("eager",),
                      tiny={"head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8,
                            "router_aux_loss_coef": 1.0}),
    # Qwen3.5's text stack (`Qwen3_5ForCausalLM`, also what AutoModelForCausalLM builds from a `qwen3_5` checkpoint):
    # Gated DeltaNet linear-attention layers and full-attention ones (3 to 1 in the released configs), a dense MLP.
    # Streamed: the full-attention layers by query chunks, the linear-attention layers (`linear_attn`) through their
    # conv and recurrent states (streaming_backward/recurrent.py). Tiny: one layer of each kind.
    "qwen3_5_text": Family("Qwen3.5 text", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", "mlp", _ATTENTION,
                           streaming_recurrent="linear_attn", tiny=_TINY_LINEAR),
    # Qwen3-Next (`qwen3_next`): Qwen3.5-MoE's forerunner, the same Gated DeltaNet and gated full-attention layers (3 to
    # 1) with a MoE block (routed experts and a gated shared expert) in every layer. Streamed as Qwen3.5 text.
    # Tiny: `_TINY_LINEAR_MOE`, as Qwen3.5-MoE text's.
    "qwen3_next": Family("Qwen3-Next", "Qwen3NextConfig", "Qwen3NextForCausalLM", "moe", _ATTENTION,
                         streaming_recurrent="linear_attn", tiny=_TINY_LINEAR_MOE),
    # Qwen3.5-MoE's text stack (`Qwen3_5MoeForCausalLM`, also what AutoModelForCausalLM builds from a `qwen3_5_moe`
    # checkpoint): Qwen3.5's layers with a MoE block (routed experts and a gated shared expert) in every layer.
    # Streamed as Qwen3.5 text. Tiny: one layer of each kind, 4 experts, top-2, the aux loss weighted 1.0.
    "qwen3_5_moe_text": Family("Qwen3.5-MoE text", "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", "moe", _ATTENTION,
                               streaming_recurrent="linear_attn", tiny=_TINY_LINEAR_MOE),
    "gemma3": Family("Gemma-3 multimodal", "Gemma3Config", "Gemma3ForConditionalGeneration", "text_config",
                     no_streaming="on `text_config`: the text layers, as Gemma-3 text (images included)"),
    # What AutoModelForCausalLM builds from a `gemma4` checkpoint. Its head caps the logits by the text config's
    # softcap (Gemma-3's composite caps none).
    "gemma4": Family("Gemma-4 multimodal", "Gemma4Config", "Gemma4ForConditionalGeneration", "text_config",
                     no_streaming="on `text_config`: the text layers, as Gemma-4 text (images included)"),
    # Qwen3-VL's text stack (`Qwen3VLTextModel`, trained inside `Qwen3VLForConditionalGeneration` only): Qwen3's
    # layers, their rotary positions multimodal (`mrope_section`: time, height, width) and computed once per step
    # before the layers, and the vision tower's deepstack features added at the image tokens after the first layers
    # (between layers: a streamed layer sees plain rows). Its tests build the composite around a tiny text config
    # (tests/test_new_families.py).
    "qwen3_vl_text": Family("Qwen3-VL text", "Qwen3VLTextConfig", "Qwen3VLTextModel", "mlp", _ATTENTION, ulysses=True),
    "qwen3_vl": Family("Qwen3-VL", "Qwen3VLConfig", "Qwen3VLForConditionalGeneration", "text_config",
                       no_streaming="on `text_config`: the text layers, as Qwen3-VL text (images and videos included)"),
    # Qwen3-VL-MoE (30B-A3B, 235B-A22B): the same composite around Qwen3-MoE's layers (routed experts, the aux loss).
    "qwen3_vl_moe_text": Family("Qwen3-VL-MoE text", "Qwen3VLMoeTextConfig", "Qwen3VLMoeTextModel", "moe", _ATTENTION, ulysses=True),
    "qwen3_vl_moe": Family("Qwen3-VL-MoE", "Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration", "text_config",
                           no_streaming="on `text_config`: the text layers, as Qwen3-VL-MoE text (images and videos "
                                        "included)"),
    # Qwen3.5 and Qwen3.5-MoE as their checkpoints load for images and videos (`Qwen3_5ForConditionalGeneration`,
    # `Qwen3_5MoeForConditionalGeneration`; AutoModelForCausalLM builds the text stack alone): the text stacks above
    # (Gated DeltaNet and full-attention layers, streamed as there) under a vision tower, with multimodal rotary
    # positions. Their tests build the composites around the tiny text configs (tests/test_new_families.py).
    "qwen3_5": Family("Qwen3.5", "Qwen3_5Config", "Qwen3_5ForConditionalGeneration", "text_config",
                      no_streaming="on `text_config`: the text layers, as Qwen3.5 text (images and videos included)"),
    "qwen3_5_moe": Family("Qwen3.5-MoE", "Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", "text_config",
                          no_streaming="on `text_config`: the text layers, as Qwen3.5-MoE text (images and videos "
                                       "included)"),
    # Mamba2: every layer a Mamba2 mixer (a 1-D convolution, then the SSD scan), streamed through its conv and SSM
    # states; mini_sequence_chunk chunks its LM head + loss, as Mamba's. Tiny: 4 heads of 16, state 8, scan chunks of 8
    # (shorter than the test sequences).
    "mamba2": Family("Mamba2", "Mamba2Config", "Mamba2ForCausalLM", "lm_head", streaming_recurrent="mixer",
                     tiny={"num_heads": 4, "head_dim": 16, "n_groups": 1, "chunk_size": 8}),
    # Mamba2 mixers beside attention layers, each layer one or the other (the recurrent ones' mixer `mamba`, found
    # without a config of its own: streaming_backward/__init__.py gives it the model's).
    # Bamba (`bamba`): dense MLPs; its layers return (hidden states, attention weights). MLP, final norm
    # (`final_layernorm`) and LM head + loss by mini-sequences, the head unless its z-loss is on (`z_loss_coefficient`:
    # over the whole logits; the head then runs unsplit, warned: mini_sequence/integration.py `computes_loss`). Tiny:
    # a Mamba2 layer (4 heads of 16, state 8, one group, scan blocks of 8) then an attention layer.
    "bamba": Family("Bamba", "BambaConfig", "BambaForCausalLM", "mlp", _ATTENTION, streaming_recurrent="mamba",
                    streaming_layer_returns=2,
                    tiny={"attn_layer_indices": [1], "mamba_n_heads": 4, "mamba_d_state": 8, "mamba_chunk_size": 8,
                          "mamba_n_groups": 1}),
    # LFM2 (`lfm2`) and LFM2-MoE (`lfm2_moe`): short gated convolutions (`conv`, a conv state only) beside attention
    # layers; LFM2-MoE's MoE blocks record their router logits (no aux loss in its head). MLP / MoE blocks, final norm
    # (`embedding_norm`) and LM head + loss by mini-sequences, as OLMo-Hybrid's and Kimi-Linear's. Tiny: a conv
    # layer, then an attention layer; LFM2-MoE with 4 experts of 16, top-2, no dense layers.
    "lfm2": Family("LFM2", "Lfm2Config", "Lfm2ForCausalLM", "mlp", _ATTENTION, streaming_recurrent="conv",
                   tiny={"layer_types": ["conv", "full_attention"], "block_auto_adjust_ff_dim": False}),
    # OLMo-Hybrid (`olmo_hybrid`): Gated DeltaNet layers (`linear_attn`) beside attention layers (OLMo-3's, their MLP's
    # output normed with the MLP by mini-sequences). Tiny: one of each.
    "olmo_hybrid": Family("OLMo-Hybrid", "OlmoHybridConfig", "OlmoHybridForCausalLM", "mlp", _ATTENTION,
                          streaming_recurrent="linear_attn",
                          tiny={"layer_types": ["linear_attention", "full_attention"], "linear_num_key_heads": 2,
                                "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
                                "eos_token_id": 2}),
    # Granite-4.0-H (`granitemoehybrid`): Bamba's layers with a MoE block (routed experts and a shared MLP) in each,
    # the router's aux loss. MoE block, shared MLP, final norm and LM head + loss by mini-sequences (its head is
    # GraniteMoE's). Tiny: 4 experts of 16, top-2, a shared MLP of 64, the aux loss weighted 1.0; RoPE.
    "granitemoehybrid": Family("Granite-4.0-H", "GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", "moe",
                               _ATTENTION, streaming_recurrent="mamba",
                               tiny={"layer_types": ["linear_attention", "full_attention"], "intermediate_size": 16,
                                     "shared_intermediate_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2,
                                     "mamba_n_heads": 4, "mamba_d_state": 8, "mamba_chunk_size": 8,
                                     "mamba_n_groups": 1, "position_embedding_type": "rope",
                                     "router_aux_loss_coef": 1.0}),
    # Nemotron-H (`nemotron_h`): blocks of one kind each (`layers_block_type`: a Mamba2 mixer, attention, an MLP or a
    # MoE block with a shared expert), every one under the attribute `mixer`: the Mamba2 blocks stream through their
    # state, the attention blocks by query chunks, the MLP and MoE blocks (token by token: no state) by chunks of tokens
    # (streaming_backward/parts.py: positionwise_mixer); by mini-sequences the MLP and MoE blocks, the final norm
    # (`norm_f`) and the LM head + loss (its head's fp32 logits are what the chunked loss computes in). Router logits
    # recorded, no aux loss in its head. Tiny: one block of each kind.
    "nemotron_h": Family("Nemotron-H", "NemotronHConfig", "NemotronHForCausalLM", "moe", _ATTENTION,
                         streaming_recurrent="mixer",
                         tiny={"layers_block_type": ["linear_attention", "moe", "full_attention", "mlp"],
                               "num_hidden_layers": 4, "head_dim": 8, "ssm_state_size": 8, "mamba_num_heads": 4,
                               "mamba_head_dim": 16, "n_groups": 1, "chunk_size": 8, "n_routed_experts": 4,
                               "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                               "moe_shared_expert_intermediate_size": 16}),
    "lfm2_moe": Family("LFM2-MoE", "Lfm2MoeConfig", "Lfm2MoeForCausalLM", "moe", _ATTENTION,
                       streaming_recurrent="conv",
                       tiny={"layer_types": ["conv", "full_attention"], "num_dense_layers": 0, "num_experts": 4,
                             "num_experts_per_tok": 2, "moe_intermediate_size": 16}),
    # Kimi-Linear (`kimi_linear`): Kimi Delta Attention layers and latent-attention (MLA) layers, both under
    # `self_attn` (told apart by the layer's `block_type`), MoE blocks with a shared expert recording their router
    # logits (no aux loss in its head). Tiny: one layer of each kind, DeepSeek-V3-style experts (4, top-2, 2 groups).
    "kimi_linear": Family("Kimi-Linear", "KimiLinearConfig", "KimiLinearForCausalLM", "moe", _ATTENTION,
                          streaming_recurrent="self_attn",
                          tiny={**_TINY_LATENT, "layer_types": ["linear_attention", "full_attention"],
                                "mlp_layer_types": ["sparse", "sparse"], "linear_num_heads": 4, "linear_head_dim": 8,
                                "num_local_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                                "n_shared_experts": 1, "n_group": 2, "topk_group": 1, "bos_token_id": 1,
                                "eos_token_id": 2}),
    # Jamba (`jamba`; Jamba-Mini/Large 1.5-1.7): Mamba (selective-scan) layers and attention layers, a MoE block of
    # routed experts on every other layer, the router's aux loss in the head. MLP and MoE blocks, final norm and LM
    # head + loss by mini-sequences. Streamed as the other hybrids: its Mamba layers (`mamba`) through their state,
    # whose scan, which upstream starts from zero on every call, is ours from the carried state in a streamed chunk
    # (patch 0011, adjoint_sharding/integration.py). Tiny: a Mamba layer with an MLP, then an attention layer with 4
    # experts (top-2), the aux loss weighted 1.0.
    "jamba": Family("Jamba", "JambaConfig", "JambaForCausalLM", "moe", _ATTENTION, streaming_recurrent="mamba",
                    tiny={"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
                          "expert_layer_offset": 1, "num_experts": 4, "num_experts_per_tok": 2, "mamba_d_state": 8,
                          "mamba_dt_rank": 4, "router_aux_loss_coef": 1.0}),
    # Falcon-H1 (`falcon_h1`): in every decoder layer a Mamba2 mixer and attention side by side on the same input,
    # their outputs summed, then an MLP; muP multipliers throughout, and a head that multiplies the logits by
    # `lm_head_multiplier` (the chunked loss takes the hidden states so multiplied: one rounding where it is not a power
    # of two, as Granite's division). MLP, final norm and LM head + loss by mini-sequences. Each layer streams by query
    # chunks, meeting both seams in one forward: its attention the K/V cache, its Mamba2 mixer (`mamba`) the carried
    # states (streaming_backward/layer.py, `states_mixer`). Tiny: a Mamba2 mixer of 4 heads of 16 (state 8, scan
    # blocks of 8), every multiplier away from 1.
    "falcon_h1": Family("Falcon-H1", "FalconH1Config", "FalconH1ForCausalLM", "mlp", _ATTENTION,
                        streaming_recurrent="mamba", streaming_layer_returns=1,
                        tiny={"mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 8,
                              "mamba_chunk_size": 8, "mamba_n_groups": 1, "lm_head_multiplier": 0.375,
                              "embedding_multiplier": 2.0, "mlp_multipliers": [0.5, 1.5], "key_multiplier": 0.7,
                              "attention_in_multiplier": 0.8, "attention_out_multiplier": 1.2,
                              "ssm_multipliers": [0.9, 1.1, 0.8, 1.2, 0.7], "ssm_in_multiplier": 0.9,
                              "ssm_out_multiplier": 1.1}),
    # Zamba (`zamba`) and Zamba2 (`zamba2`): Mamba / Mamba2 layers, some of them hybrid: a shared attention block
    # (attention then an MLP, on the layer's input joined to the embeddings, with per-layer adapters) whose output
    # goes into the layer's mixer. Final norm (`final_layernorm`) and LM head + loss by mini-sequences (patches 0009,
    # 0012); their MLPs take a layer index and hold every hybrid layer's adapters: not chunked. Zamba2 streams: its
    # Mamba2 layers through their state, its hybrid layers as Falcon-H1's (`streaming_nested`; the attention runs
    # before the mixer there, so no query chunk may read keys after its rows: left padding is refused). Zamba's
    # Mamba (selective-scan) mixer starts every call from a zero state: not streamed. Tiny: a Mamba layer and two
    # hybrid layers (Zamba's ties need two), Zamba2's with rotary positions and adapters (which upstream builds for
    # as many key/value heads as query heads only).
    "zamba": Family("Zamba", "ZambaConfig", "ZambaForCausalLM", "lm_head",
                    no_streaming="ignored (warned): its Mamba mixer's scan starts from a zero state",
                    tiny={"layers_block_type": ["mamba", "hybrid", "hybrid"], "num_hidden_layers": 3,
                          "mamba_d_state": 8, "n_mamba_heads": 2, "mamba_dt_rank": 4}),
    "zamba2": Family("Zamba2", "Zamba2Config", "Zamba2ForCausalLM", "lm_head", _ATTENTION,
                     streaming_recurrent="mamba",
                     streaming_nested={"Zamba2HybridLayer": ("shared_transformer.self_attn", "mamba_decoder.mamba",
                                                             "causal_mask")},
                     tiny={"layers_block_type": ["mamba", "hybrid", "hybrid"], "num_hidden_layers": 3,
                           "mamba_d_state": 8, "n_mamba_heads": 4, "chunk_size": 8, "use_mem_rope": True,
                           "num_key_value_heads": 4, "use_shared_attention_adapter": True, "adapter_rank": 4}),
    # Mamba and FalconMamba: adjoint sharding's fields, and streamed through their state as Mamba2 (their scan in a
    # streamed chunk ours, from the carried state: patch 0011).
    "mamba": Family("Mamba", "MambaConfig", "MambaForCausalLM", "lm_head", streaming_recurrent="mixer", adjoint=True,
                    tiny={}),
    "falcon_mamba": Family("FalconMamba", "FalconMambaConfig", "FalconMambaForCausalLM", "lm_head",
                           streaming_recurrent="mixer", adjoint=True, tiny={}),
}

# The tests' tiny models (tests/tiny_models.py): shared sizes, per family `Family.tiny` on top.
TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0)
TINY_SSM = dict(vocab_size=128, hidden_size=32, state_size=8, expand=2, num_hidden_layers=2, pad_token_id=0)

# The planner's full-size shapes (`--model NAME`): name -> (model_type, the released checkpoint's config.json values).
CHECKPOINTS = {
    "llama3-8b": ("llama", dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0)),
    "llama2-7b": ("llama", dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=32)),
    "qwen2-7b": ("qwen2", dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                               num_attention_heads=28, num_key_value_heads=4)),
    "mistral-7b": ("mistral", dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                   num_attention_heads=32, num_key_value_heads=8, sliding_window=4096)),
    # Qwen/Qwen3-8B: q/k norms; the model of StreamBP's Table 3 (arXiv 2506.03077).
    "qwen3-8b": ("qwen3", dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1000000.0)),
    "gemma2-9b": ("gemma2", dict(vocab_size=256000, hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256,
                                 sliding_window=4096, final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
                                 tie_word_embeddings=True)),
    # Qwen/Qwen3-14B, Qwen/Qwen3-32B (dense, q/k norms, untied head).
    "qwen3-14b": ("qwen3", dict(vocab_size=151936, hidden_size=5120, intermediate_size=17408, num_hidden_layers=40,
                                num_attention_heads=40, num_key_value_heads=8, head_dim=128, rope_theta=1000000.0)),
    "qwen3-32b": ("qwen3", dict(vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                                num_attention_heads=64, num_key_value_heads=8, head_dim=128, rope_theta=1000000.0)),
    # google/gemma-3-12b-it and -27b-it: their config.json's text_config (the planner plans the text stack); five
    # sliding-window (1024) layers per full-attention one (Gemma3TextConfig's default pattern), tied head.
    "gemma3-12b": ("gemma3_text", dict(vocab_size=262208, hidden_size=3840, intermediate_size=15360,
                                       num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=8,
                                       head_dim=256, query_pre_attn_scalar=256, sliding_window=1024)),
    "gemma3-27b": ("gemma3_text", dict(vocab_size=262208, hidden_size=5376, intermediate_size=21504,
                                       num_hidden_layers=62, num_attention_heads=32, num_key_value_heads=16,
                                       head_dim=128, query_pre_attn_scalar=168, sliding_window=1024)),
    # Qwen/Qwen3-30B-A3B: 128 experts of 768, 8 per token, in every layer.
    "qwen3-30b-a3b": ("qwen3_moe", dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                        moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                                        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                                        decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                                        rope_theta=1000000.0)),
    # openai/gpt-oss-20b: 32 experts, 4 per token; sliding (128) and full attention layers alternate.
    "gpt-oss-20b": ("gpt_oss", dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                                    num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
                                    num_experts_per_tok=4, sliding_window=128, tie_word_embeddings=False)),
    # allenai/OLMoE-1B-7B-0924: 64 experts of 1024, 8 per token (16 x 64 x 3 x 2048 x 1024 = 6.4B of its 6.9B).
    "olmoe-1b-7b": ("olmoe", dict(vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
                                  num_attention_heads=16, num_key_value_heads=16, num_experts=64,
                                  num_experts_per_tok=8)),
    # deepseek-ai/DeepSeek-V2-Lite: latent attention without a query LoRA; layer 0 dense, then 64 routed experts (6
    # per token) and 2 shared ones of 1408 (26 x 66 x 3 x 2048 x 1408 = 14.8B of its 15.7B).
    "deepseek-v2-lite": ("deepseek_v2", dict(vocab_size=102400, hidden_size=2048, intermediate_size=10944,
                                             moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
                                             num_key_value_heads=16, n_routed_experts=64, n_shared_experts=2,
                                             num_experts_per_tok=6, first_k_dense_replace=1, kv_lora_rank=512,
                                             q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                             v_head_dim=128)),
    # zai-org/GLM-4.5-Air: layer 0 dense, then 128 routed experts (8 per token) and a shared one of 1408
    # (45 x 129 x 3 x 4096 x 1408 = 100B of its 106B); 96 query heads of 128, 8 K/V heads.
    "glm-4.5-air": ("glm4_moe", dict(vocab_size=151552, hidden_size=4096, intermediate_size=10944,
                                     moe_intermediate_size=1408, num_hidden_layers=46, num_attention_heads=96,
                                     num_key_value_heads=8, head_dim=128, n_routed_experts=128, n_shared_experts=1,
                                     num_experts_per_tok=8, first_k_dense_replace=1)),
    # zai-org/GLM-4.7-Flash: latent attention; layer 0 dense, then 64 routed experts (4 per token) and a shared one of
    # 1536 (46 x 65 x 3 x 2048 x 1536 = 28B of its 30B).
    "glm-4.7-flash": ("glm4_moe_lite", dict(vocab_size=154880, hidden_size=2048, intermediate_size=10240,
                                            moe_intermediate_size=1536, num_hidden_layers=47, num_attention_heads=20,
                                            num_key_value_heads=20, n_routed_experts=64, n_shared_experts=1,
                                            num_experts_per_tok=4, kv_lora_rank=512, q_lora_rank=768,
                                            qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256)),
    # meta-llama/Llama-4-Scout-17B-16E (its text_config): a MoE block in every layer, 16 experts of 8192 that each see
    # every token (top-1 scores) and a shared one; chunked attention (8192) on 3 layers of 4, NoPE on the 4th.
    # 107.8B parameters as built (the published 109B has the vision tower too).
    "llama4-scout": ("llama4_text", dict(vocab_size=202048, hidden_size=5120, intermediate_size=8192,
                                         intermediate_size_mlp=16384, num_hidden_layers=48, num_attention_heads=40,
                                         num_key_value_heads=8, head_dim=128, num_local_experts=16,
                                         num_experts_per_tok=1, interleave_moe_layer_step=1,
                                         attention_chunk_size=8192, rope_theta=500000.0)),
    # Qwen/Qwen3-Next-80B-A3B (model card): 48 layers, 3 Gated DeltaNet (16 QK and 32 V heads of 128) to 1 gated
    # attention layer (16 query and 2 KV heads of 256, RoPE on 64 of them), every layer MoE with 512 experts of 512,
    # 10 per token, and a shared expert of 512: upstream's Qwen3NextConfig defaults, written out.
    "qwen3-next-80b-a3b": ("qwen3_next", dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=48,
                                              num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                                              linear_key_head_dim=128,
                                              linear_value_head_dim=128, linear_num_key_heads=16,
                                              linear_num_value_heads=32, num_experts=512, num_experts_per_tok=10,
                                              moe_intermediate_size=512, shared_expert_intermediate_size=512)),
    # Qwen/Qwen3.5-35B-A3B's text stack: upstream's Qwen3_5MoeTextConfig defaults, which its docstring names as that
    # checkpoint's: 40 layers (3 Gated DeltaNet to 1 attention), 256 experts of 512, 8 per token, a shared expert.
    "qwen3.5-35b-a3b": ("qwen3_5_moe_text", dict(vocab_size=248320, hidden_size=2048, num_hidden_layers=40,
                                                 num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                                                 linear_key_head_dim=128, linear_value_head_dim=128,
                                                 linear_num_key_heads=16, linear_num_value_heads=32, num_experts=256,
                                                 num_experts_per_tok=8, moe_intermediate_size=512,
                                                 shared_expert_intermediate_size=512)),
    # Qwen/Qwen3.5-27B's text stack (its config.json's text_config): 64 layers, 3 Gated DeltaNet (16 key and 48 value
    # heads of 128) to 1 gated attention layer (24 query and 4 KV heads of 256), dense MLPs of 17408, untied head.
    "qwen3.5-27b": ("qwen3_5_text", dict(vocab_size=248320, hidden_size=5120, intermediate_size=17408,
                                         num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4,
                                         head_dim=256, linear_key_head_dim=128, linear_value_head_dim=128,
                                         linear_num_key_heads=16, linear_num_value_heads=48,
                                         linear_conv_kernel_dim=4, tie_word_embeddings=False)),
    # ibm-granite/granite-4.0-h-small: 40 layers, Mamba2 mixers (128 heads of 64, state 128, one group) but attention on
    # layers 5, 15, 25, 35 (32 query and 8 KV heads, no positions), every layer a MoE block of 72 experts of 768, 10 per
    # token, and a shared MLP of 1536; tied head. muP multipliers left at 1: they change no tensor's size.
    "granite-4.0-h-small": ("granitemoehybrid", dict(
        vocab_size=100352, hidden_size=4096, intermediate_size=768, shared_intermediate_size=1536,
        num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8, num_local_experts=72,
        num_experts_per_tok=10, mamba_n_heads=128, mamba_d_head=64, mamba_d_state=128, mamba_n_groups=1,
        mamba_d_conv=4, mamba_expand=2, position_embedding_type="nope", tie_word_embeddings=True,
        layer_types=["attention" if i % 10 == 5 else "mamba" for i in range(40)])),
    # nvidia/Nemotron-H-8B-Base-8K: 52 layers of one kind each, 24 Mamba2 (128 heads of 64, state 128, 8 groups),
    # 4 attention (32 query and 8 KV heads of 128), 24 squared-ReLU MLPs of 21504; untied head.
    "nemotron-h-8b": ("nemotron_h", dict(vocab_size=131072, hidden_size=4096, intermediate_size=21504,
                                         hybrid_override_pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
                                         num_hidden_layers=52, num_attention_heads=32, num_key_value_heads=8,
                                         head_dim=128, mamba_num_heads=128, mamba_head_dim=64, ssm_state_size=128,
                                         n_groups=8, conv_kernel=4, expand=2, tie_word_embeddings=False)),
    # tiiuae/Falcon-H1-34B-Instruct (its config.json): 72 layers, each an attention block (20 query and 4 KV heads of
    # 128) beside a Mamba2 mixer (32 heads of 128, state 256, 2 groups, RMS-normed output) and a dense MLP of 21504;
    # untied head over 261120 tokens (33.64B parameters). The muP multipliers change no tensor's size.
    "falcon-h1-34b": ("falcon_h1", dict(vocab_size=261120, hidden_size=5120, intermediate_size=21504,
                                        num_hidden_layers=72, num_attention_heads=20, num_key_value_heads=4,
                                        head_dim=128, mamba_d_ssm=4096, mamba_n_heads=32, mamba_d_head=128,
                                        mamba_n_groups=2, mamba_d_state=256, mamba_d_conv=4, mamba_expand=2,
                                        mamba_chunk_size=128, mamba_conv_bias=True, mamba_proj_bias=False,
                                        mamba_rms_norm=True, mamba_norm_before_gate=False, projectors_bias=False,
                                        rope_theta=1e11, tie_word_embeddings=False)),
    # ai21labs/AI21-Jamba-1.5-Mini (its config.json): 32 layers, attention on every 8th from layer 4 (32 query and 8 KV
    # heads of 128), Mamba (selective scan, state 16, expand 2, dt rank 256) on the other 28; a MoE block of 16 experts
    # of 14336 (2 per token) on every odd layer, a dense MLP of 14336 on the even ones; untied head (51.6B parameters).
    "jamba-mini": ("jamba", dict(vocab_size=65536, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                 num_attention_heads=32, num_key_value_heads=8, attn_layer_offset=4,
                                 attn_layer_period=8, expert_layer_offset=1, expert_layer_period=2, num_experts=16,
                                 num_experts_per_tok=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
                                 mamba_dt_rank=256, mamba_conv_bias=True, mamba_proj_bias=False,
                                 sliding_window=None, tie_word_embeddings=False)),
    # mistralai/Mixtral-8x7B-v0.1: 8 experts, 2 per token; no sliding window.
    "mixtral-8x7b": ("mixtral", dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                     num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
                                     num_experts_per_tok=2, sliding_window=None, rope_theta=1000000.0)),
}


def streaming_model_types() -> tuple:
    """The model types streaming_backward_chunk streams."""
    return tuple(t for t, family in FAMILIES.items() if family.streaming_attention or family.streaming_recurrent)


def streaming_refusal(config) -> str | None:
    """Why `config`, of a streamed family, is not streamed (its `streaming_unless` attribute is set), or None."""
    family = FAMILIES.get(getattr(config, "model_type", None))
    if family is None or family.streaming_unless is None:
        return None
    attribute, what = family.streaming_unless
    value = getattr(config, attribute, None)
    return f"{what} ({attribute}={value!r})" if value else None


def model_types(**wanted) -> tuple:
    """The model types whose entry has every given value, e.g. `model_types(ulysses=True)`; a tuple value means any
    of its members (`model_types(mini_sequence=("mlp", "moe"))`)."""

    def matches(family, key, value):
        return getattr(family, key) in value if isinstance(value, tuple) else getattr(family, key) == value

    return tuple(t for t, family in FAMILIES.items() if all(matches(family, k, v) for k, v in wanted.items()))


_MINI_SEQUENCE_CELLS = {
    "mlp": "yes",
    "moe": "yes, MoE blocks (router logits, aux loss exact)",
    "lm_head": "final norm, LM head + loss",
    "text_config": "on `text_config`: text MLP and the composite's LM head + loss",
    None: "ignored",
}


def _cells(family: Family) -> tuple:
    streaming = f"yes: {', '.join(family.streaming_attention)}" if family.streaming_attention else family.no_streaming
    if family.streaming_recurrent:  # a hybrid's attention layers by query chunks, its recurrent ones through their state
        streaming = (f"{streaming}; recurrent mixers through their state" if family.streaming_attention
                     else "yes: through the recurrent state")
    if family.streaming_unless is not None:
        attribute, what = family.streaming_unless
        streaming += f"; ignored (warned) with {what} (`{attribute}` non-zero)"
    return _MINI_SEQUENCE_CELLS[family.mini_sequence], streaming, "yes" if family.adjoint else "ignored"


def support_matrix() -> str:
    """The README's table: one row per run of consecutive families with the same cells."""
    rows = []
    for model_type, family in FAMILIES.items():
        cells = _cells(family)
        if rows and rows[-1][1] == cells:
            rows[-1][0].append((family.name, model_type))
        else:
            rows.append(([(family.name, model_type)], cells))
    lines = [
        "| family (`model_type`) | `mini_sequence_chunk` | `streaming_backward_chunk` | adjoint fields |",
        "|---|---|---|---|",
    ]
    for members, cells in rows:
        names = ", ".join(name for name, _ in members)
        types = ", ".join(f"`{t}`" for _, t in members)
        lines.append(f"| {names} ({types}) | " + " | ".join(cells) + " |")
    lines.append("| any other model type | ignored (warned) | ignored (warned) | ignored (warned) |")
    return "\n".join(lines)

"""Memory and time of a training step of the hybrids' layer kinds, streamed against gradient checkpointing
(`bench.py hybrids`; docs/streaming.md, "Recurrent layers").

Six d=256 models, fp32, batch 1, V=1000, CPU: `gated_deltanet` (Qwen3-Next's layers: 2 Gated DeltaNet layers of 2 key
and 4 value heads of 64, a MoE block of 4 experts of 128, top-2, and a shared expert of 128, in each), `qwen3_next`
(the same with its second layer gated attention, 4 query and 2 KV heads of 64), `granite_h` (Granite-4.0-H: a
Mamba2 layer of 8 heads of 64, state 16, then an attention layer; MoE of 4 experts, top-2, a shared MLP of 512),
`falcon_h1` (since 5.24.0+mst.34: 2 Falcon-H1 layers, each a Mamba2 mixer of 8 heads of 64, state 16, beside attention
of 4 query and 2 KV heads of 64, then an MLP of 512), `nemotron_h` (since mst.36: a Nemotron-H Mamba2 block of 8 heads
of 64, state 16, then an MLP block of 1344, squared ReLU, Nemotron-H-8B's ratio to d) and `zamba2` (since mst.34: a
Zamba2 Mamba2 layer of 8 heads of 64, state 16, then a hybrid layer: the shared block's attention of 4 heads of 128
and MLP of 512 on the input joined to the embeddings, then its Mamba2 layer). Not Jamba: its checkpointed step runs upstream's PyTorch selective scan,
whose backward on the CPU is quadratic in the length (one zero-filled `[B, D, S, N]` gradient per token;
docs/adjoint-sharding.md).
Methods: `checkpointing` (the fields unset, `activation_checkpointing_enable()`), `mini_sequence+checkpointing`
(mini_sequence_chunk "auto" under checkpointing: the MLP / MoE blocks, final norm and LM head + loss by mini-sequences;
since 5.24.0+mst.33 on Granite-4.0-H), `streaming` (streaming_backward_chunk "auto") and `both` ("auto" for both
fields).

peak_MiB: the live tensor bytes of one forward + backward (`LiveTensorTracker`: the step's own tensors, not the
weights); inputs_MiB: the layer inputs every method keeps ([S, d] fp32 per layer); step_time_s: the fastest of
`repeats` steps after one untimed step.
"""

import time

import torch

import transformers
from transformers.mst_core.memory import LiveTensorTracker

MIB = 2**20
HIDDEN, LAYERS, VOCAB = 256, 2, 1000
_QWEN3_NEXT = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=512, num_hidden_layers=LAYERS,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_key_head_dim=64,
                   linear_value_head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4,
                   num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=128)
MODELS = {
    "gated_deltanet": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM,
                       dict(_QWEN3_NEXT, layer_types=["linear_attention", "linear_attention"])),
    "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM,
                   dict(_QWEN3_NEXT, layer_types=["linear_attention", "full_attention"])),
    "granite_h": (transformers.GraniteMoeHybridConfig, transformers.GraniteMoeHybridForCausalLM,
                  dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, shared_intermediate_size=512,
                       num_hidden_layers=LAYERS, layer_types=["linear_attention", "full_attention"],
                       num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                       mamba_n_heads=8, mamba_d_head=64, mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=256,
                       position_embedding_type="rope", max_position_embeddings=1 << 20)),
    "falcon_h1": (transformers.FalconH1Config, transformers.FalconH1ForCausalLM,
                  dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=512, num_hidden_layers=LAYERS,
                       num_attention_heads=4, num_key_value_heads=2, mamba_d_ssm=512, mamba_n_heads=8,
                       mamba_d_head=64, mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=256,
                       max_position_embeddings=1 << 20)),
    "nemotron_h": (transformers.NemotronHConfig, transformers.NemotronHForCausalLM,
                   dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=1344, num_hidden_layers=LAYERS,
                        layers_block_type=["linear_attention", "mlp"], num_attention_heads=4, num_key_value_heads=2,
                        head_dim=64, mamba_num_heads=8, mamba_head_dim=64, ssm_state_size=16, n_groups=1,
                        chunk_size=256, max_position_embeddings=1 << 20)),
    "zamba2": (transformers.Zamba2Config, transformers.Zamba2ForCausalLM,
               dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=512, num_hidden_layers=LAYERS,
                    layers_block_type=["mamba", "hybrid"], num_attention_heads=4, num_key_value_heads=4,
                    n_mamba_heads=8, mamba_d_state=16, chunk_size=256, max_position_embeddings=1 << 20)),
}
# method -> (streaming_backward_chunk, mini_sequence_chunk, checkpointing)
METHODS = {"checkpointing": (None, None, True), "mini_sequence+checkpointing": (None, "auto", True),
           "streaming": ("auto", None, False), "both": ("auto", "auto", False)}


def build(name, method):
    config_class, model_class, sizes = MODELS[name]
    streaming, mini_sequence, checkpointing = METHODS[method]
    config = config_class(**sizes, streaming_backward_chunk=streaming, mini_sequence_chunk=mini_sequence,
                          attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    model = model_class(config).train()
    if checkpointing:
        model.activation_checkpointing_enable()
    return model


def step(model, ids):
    model(input_ids=ids, labels=ids).loss.backward()
    model.zero_grad(set_to_none=True)


def measure(name, method, seq, repeats):
    model = build(name, method)
    ids = torch.randint(1, VOCAB, (1, seq), generator=torch.Generator().manual_seed(0))
    step(model, ids)  # untimed: first-call costs
    with LiveTensorTracker(keep_largest=0) as tracker:
        step(model, ids)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step(model, ids)
        times.append(time.perf_counter() - start)
    return tracker.peak_bytes, min(times)


def sweep_hybrids(seqs, repeats, models=tuple(MODELS), progress=None):
    rows = []
    for name in models:
        for seq in seqs:
            measured = {}
            for method in METHODS:
                measured[method] = measure(name, method, seq, repeats)
                if progress is not None:
                    progress.update(1)
            checkpointing_time = measured["checkpointing"][1]
            for method, (peak, seconds) in measured.items():
                rows.append({"model": name, "method": method, "seq_len": seq, "peak_MiB": round(peak / MIB, 1),
                             "inputs_MiB": round(LAYERS * seq * HIDDEN * 4 / MIB, 1),
                             "step_time_s": round(seconds, 3),
                             "speed_vs_checkpointing": round(checkpointing_time / seconds, 3)})
    return rows


def header(repeats):
    return (f"transformers {transformers.__version__}, torch {torch.__version__}, CPU, {torch.get_num_threads()} "
            f"threads; d={HIDDEN}, {LAYERS} layers, V={VOCAB}, batch 1, fp32, sdpa; peak_MiB: live tensor bytes of one "
            f"forward + backward (weights not counted); step time: the fastest of {repeats} steps after one untimed; "
            "speed_vs_checkpointing: checkpointing's step time over this one, same run (scripts/hybrid_bench.py)")

"""What `mini_sequence_chunk` adds to streaming on the hybrids whose LM head + loss it chunks since 5.24.0+mst.31
(Nemotron-H, Bamba, Granite-4.0-H): the live tensor bytes of one training step, streamed alone and with
mini-sequences, at their checkpoints' vocabulary sizes (the [S, V] logits are what the field removes). CPU, fp32, batch 1, d = 256, "auto"
for each field set; peak: `LiveTensorTracker` (the step's own tensors, not the weights), the step after an untimed
one. CHANGELOG.md (mst.31) quotes `--seq 4096 8192`.
"""

import argparse

import torch

import transformers
from transformers.mst_core.memory import LiveTensorTracker

MIB = 2**20
MODELS = {
    # Nemotron-H: one block of each kind (Mamba2, MoE, attention, MLP), NVIDIA's vocabulary of 131072
    "nemotron_h": (transformers.NemotronHConfig, transformers.NemotronHForCausalLM,
                   dict(vocab_size=131072, hidden_size=256, num_hidden_layers=4, intermediate_size=512,
                        layers_block_type=["linear_attention", "moe", "full_attention", "mlp"],
                        num_attention_heads=4, num_key_value_heads=2, head_dim=64, ssm_state_size=16,
                        mamba_num_heads=8, mamba_head_dim=64, n_groups=1, chunk_size=256, n_routed_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=128, moe_shared_expert_intermediate_size=128)),
    # Bamba: a Mamba2 layer, then an attention layer; Bamba-9B's vocabulary of 128000
    "bamba": (transformers.BambaConfig, transformers.BambaForCausalLM,
              dict(vocab_size=128000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                   attn_layer_indices=[1], num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8,
                   mamba_d_head=64, mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=256)),
    # Granite-4.0-H: a Mamba2 layer, then an attention layer, each with a MoE block (4 experts, top-2) and a shared
    # MLP; Granite-4.0's vocabulary of 100352
    "granitemoehybrid": (transformers.GraniteMoeHybridConfig, transformers.GraniteMoeHybridForCausalLM,
                         dict(vocab_size=100352, hidden_size=256, intermediate_size=128, shared_intermediate_size=512,
                              num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                              num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                              num_experts_per_tok=2, mamba_n_heads=8, mamba_d_head=64, mamba_d_state=16,
                              mamba_n_groups=1, mamba_chunk_size=256, position_embedding_type="rope",
                              max_position_embeddings=1 << 20)),
}
METHODS = {"streaming": dict(streaming_backward_chunk="auto"),
           "streaming+mini_sequence": dict(streaming_backward_chunk="auto", mini_sequence_chunk="auto")}


def measure(name, method, seq, vocab=None):
    """(peak live MiB, loss) of one step of `name` under `method` on `seq` tokens (`vocab`: another vocabulary size
    than the checkpoint's)."""
    config_class, model_class, sizes = MODELS[name]
    sizes = {**sizes, **({"vocab_size": vocab} if vocab else {})}
    config = config_class(**sizes, **METHODS[method], attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    model = model_class(config).train()
    ids = torch.randint(1, 1000, (1, seq), generator=torch.Generator().manual_seed(0))

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss.item()

    step()
    with LiveTensorTracker(keep_largest=0) as tracker:
        loss = step()
    return tracker.peak_bytes / MIB, loss


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--vocab", type=int, default=None,
                        help="one vocabulary size for every model instead of its checkpoint's (at least 1000)")
    args = parser.parse_args()
    if args.vocab is not None and args.vocab < 1000:
        parser.error(f"--vocab {args.vocab}: the steps' token ids go up to 999; allowed: at least 1000")
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, CPU, fp32, batch 1, d=256")
    print("| model | V | tokens | streaming, MiB | streaming + mini_sequence, MiB | loss (streaming / both) |")
    print("|---|---:|---:|---:|---:|---|")
    for name in args.models:
        for seq in args.seq:
            (alone, loss_alone), (both, loss_both) = (measure(name, method, seq, args.vocab) for method in METHODS)
            print(f"| {name} | {args.vocab or MODELS[name][2]['vocab_size']} | {seq} | {alone:.1f} | {both:.1f} | "
                  f"{loss_alone:.6f} / {loss_both:.6f} |", flush=True)


if __name__ == "__main__":
    main()

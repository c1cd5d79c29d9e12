"""Smoke demo: a few AdamW steps of a small random-init Llama on random tokens.

The full demo (real text, a trained BPE tokenizer, >= 8K-token sequences, flag on vs off)
is issue 4's; this one proves the installed distribution trains end to end.
"""

import argparse
import time

import torch

import transformers
from transformers import LlamaConfig, LlamaForCausalLM


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=args.seq_len)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = torch.randint(0, config.vocab_size, (1, args.seq_len))
    for step in range(args.steps):
        start = time.perf_counter()
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print(f"step {step}: loss {loss.item():.4f}  ({time.perf_counter() - start:.2f} s)")


if __name__ == "__main__":
    main()

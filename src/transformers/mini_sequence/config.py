"""Chunk-size policy for the ``mini_sequence_chunk`` config field (its validation: mst_core/fields.py).

Importable without torch. Allowed values (README, "The fields"; docs/mini-sequence.md):

- ``None``: mini-sequence processing off, exactly upstream behaviour.
- ``"auto"``: the paper's policy (MsT §3.4): MLP chunks of ``C = hidden_size`` tokens (on an accelerator at
  least `AUTO_MIN_MLP_TOKENS_ACCELERATOR`), LM head split into ``M = ceil(vocab_size / hidden_size)`` mini-sequences.
- a positive ``int`` C: mini-sequences of C tokens for both the MLP and the LM head.
"""

import math

from ..mst_core.fields import MINI_SEQUENCE_ALLOWED, MINI_SEQUENCE_FIELD, hidden_size_chunk, validate_mini_sequence_chunk


# On an accelerator (any device but the CPU) "auto" MLP mini-sequences are at least this many tokens. Each one costs
# a round of host work (its forward; in backward its recompute and an `autograd.grad`), which the GPU waits for, and
# its weight gradients as fp32-output GEMMs. Measured on an H200 (docs/cuda/README.md, Llama-3.2-1B shapes, d = 2048,
# bf16, mini_sequence+checkpointing against checkpointing's speed, one machine, 3 steps): 4K tokens 0.79x in chunks
# of 2048, 0.88x / 1.02x unsplit (two runs); 16K 0.90x / 0.91x (2048 / 4096) for 10.54 / 10.60 GiB; 32K 0.93x / 0.94x,
# 12.00 GiB both. Chunks of 8192 bought no more speed and cost 0.47 GiB at 16K. With this floor, 10 steps at 4K:
# 0.74x -> 1.04x. On the CPU the work is the arithmetic, not its launch (docs/measurements.md): C = d there.
AUTO_MIN_MLP_TOKENS_ACCELERATOR = 4096


def mlp_chunk_size(value, hidden_size: int, device_type: str = "cpu") -> int:
    """Tokens per MLP mini-sequence. ``"auto"`` -> ``hidden_size`` (MsT §3.4: C = d keeps
    the MLP compute-bound, and a sequence no longer than d is not split at all), and on an accelerator at least
    `AUTO_MIN_MLP_TOKENS_ACCELERATOR`."""
    chunk = hidden_size_chunk(MINI_SEQUENCE_FIELD, value, MINI_SEQUENCE_ALLOWED, hidden_size)
    if value == "auto" and device_type != "cpu":
        return max(chunk, AUTO_MIN_MLP_TOKENS_ACCELERATOR)
    return chunk


# "auto" never makes LM-head chunks smaller than this. Each chunk re-reads the whole [V, d] weight
# and adds into the whole [V, d] weight gradient, so tiny chunks cost time for no needed memory:
# CPU, d=256, V=32000, 4096 tokens, loss forward+backward: unsplit 1.69 s; chunks of 8 tokens
# 4.35 s, 33 (= N / ceil(V/d)) 2.13 s, 128 1.40 s, 1024 1.27 s. Long sequences keep the paper's
# M = ceil(V / d) chunks once N / M exceeds it (Llama-3-8B: N > 32K tokens).
AUTO_MIN_LM_HEAD_TOKENS = 1024
# ... and never more logits per chunk than this: N / M grows with the sequence (Llama-3-8B at 1M tokens:
# 32K-token chunks, 8 GiB of bf16 logits next to their fp32 row blocks), while a chunk of thousands of
# tokens already re-reads the [V, d] weight rarely. 2**30 logits are 2 GiB in bf16: chunks of at most
# 8371 tokens for Llama-3's V=128256 (from 268K tokens on), 4194 for Gemma-2's 256000.
AUTO_MAX_LM_HEAD_LOGITS = 2**30


def lm_head_chunk_size(value, hidden_size: int, vocab_size: int, num_tokens: int) -> int:
    """Tokens per LM-head mini-sequence. ``"auto"`` -> ``ceil(num_tokens / M)`` with
    ``M = ceil(vocab_size / hidden_size)`` (MsT §3.4: one chunk of logits [C, V] is then about
    the size of the hidden states [N, d]), at most ``AUTO_MAX_LM_HEAD_LOGITS / vocab_size`` and at
    least ``AUTO_MIN_LM_HEAD_TOKENS``."""
    validate_mini_sequence_chunk(value)
    if value is None:
        raise ValueError(f"`{MINI_SEQUENCE_FIELD}` is None: mini-sequence processing is disabled")
    if value == "auto":
        num_mini_sequences = max(1, math.ceil(vocab_size / hidden_size))
        chunk = min(math.ceil(num_tokens / num_mini_sequences), AUTO_MAX_LM_HEAD_LOGITS // vocab_size)
        return max(chunk, AUTO_MIN_LM_HEAD_TOKENS)
    return value

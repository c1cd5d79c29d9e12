"""Validation and chunk-size policy for the ``mini_sequence_chunk`` config field.

This module must stay importable without torch: configuration classes import it at
construction time.

Allowed values (README, "The fields"; docs/mini-sequence.md):

- ``None``: mini-sequence processing off, exactly upstream behaviour.
- ``"auto"``: the paper's policy (MsT §3.4): MLP chunks of ``C = hidden_size`` tokens,
  LM head split into ``M = ceil(vocab_size / hidden_size)`` mini-sequences.
- a positive ``int`` C: mini-sequences of C tokens for both the MLP and the LM head.
"""

import math


FIELD_NAME = "mini_sequence_chunk"
ALLOWED_DESCRIPTION = 'None, "auto", or a positive int (tokens per mini-sequence)'


def _validate_chunk_field(field_name: str, value, allowed: str):
    """Return ``value`` unchanged if it is None, ``"auto"`` or a positive int, else raise ``ValueError``.

    ``bool`` is rejected although it subclasses ``int`` (``True`` would silently mean chunks
    of 1 token); floats are rejected even when integral (``4.0``), so that a typo or a
    JSON round-trip surprise is reported rather than guessed at.
    """
    if value is None:
        return value
    if isinstance(value, str) and value == "auto":
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    raise ValueError(f"Invalid `{field_name}`={value!r}: expected {allowed}.")


def validate_mini_sequence_chunk(value):
    """Return ``value`` unchanged if it is a valid ``mini_sequence_chunk``, else raise ``ValueError``."""
    return _validate_chunk_field(FIELD_NAME, value, ALLOWED_DESCRIPTION)


STREAMING_FIELD_NAME = "streaming_backward_chunk"
STREAMING_ALLOWED_DESCRIPTION = 'None, "auto", or a positive int (query tokens per streamed chunk)'


def validate_streaming_backward_chunk(value):
    """Return ``value`` unchanged if it is a valid ``streaming_backward_chunk``, else raise ``ValueError``."""
    return _validate_chunk_field(STREAMING_FIELD_NAME, value, STREAMING_ALLOWED_DESCRIPTION)


def _hidden_size_chunk(field_name: str, value, allowed: str, hidden_size: int) -> int:
    """A chunk field's tokens per chunk: ``"auto"`` -> ``hidden_size``; None raises (the feature is off)."""
    _validate_chunk_field(field_name, value, allowed)
    if value is None:
        raise ValueError(f"`{field_name}` is None: the feature it sets is disabled")
    if value == "auto":
        return int(hidden_size)
    return value


def mlp_chunk_size(value, hidden_size: int) -> int:
    """Tokens per MLP mini-sequence. ``"auto"`` -> ``hidden_size`` (MsT §3.4: C = d keeps
    the MLP compute-bound, and a sequence no longer than d is not split at all)."""
    return _hidden_size_chunk(FIELD_NAME, value, ALLOWED_DESCRIPTION, hidden_size)


# Streaming "auto": `hidden_size` query tokens, as MsT's MLP mini-sequences (C = d). Measured (bench
# `streaming` sweep, CPU, d=256, 2 layers, S=8192, fp32, both flags; vs mini_sequence+checkpointing):
# chunk 256 = d: step time 1.13x, activation memory 0.81x; 512: 1.22x, 0.87x; 1024: 1.30x, 1.11x;
# 2048: 1.43x, 1.60x; 4096: 1.36x, 2.57x. Larger chunks cost memory (one chunk's working set) and time:
# the chunk's diagonal block is computed in full under the mask (c * S / 2 wasted attention per layer),
# and with mini_sequence_chunk="auto" a streamed chunk longer than d makes the MLP a mini-sequence
# Function of its own, recomputed once more in its backward; a chunk of d tokens runs the MLP unsplit.
def streaming_chunk_size(value, hidden_size: int) -> int:
    """Query tokens per streamed chunk for `streaming_backward_chunk=value`."""
    return _hidden_size_chunk(STREAMING_FIELD_NAME, value, STREAMING_ALLOWED_DESCRIPTION, hidden_size)


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
        raise ValueError(f"`{FIELD_NAME}` is None: mini-sequence processing is disabled")
    if value == "auto":
        num_mini_sequences = max(1, math.ceil(vocab_size / hidden_size))
        chunk = min(math.ceil(num_tokens / num_mini_sequences), AUTO_MAX_LM_HEAD_LOGITS // vocab_size)
        return max(chunk, AUTO_MIN_LM_HEAD_TOKENS)
    return value

"""The LM-head loss's elementwise passes over the logits as compiled kernels (torch.compile, Triton on CUDA).

loss.py computes the fp32 cross-entropy of a chunk's [C, V] logits, and its gradient, a block of rows at a time in
eager torch: `log_softmax` to an fp32 block, `exp_`, `mul_`, `scatter_add_`, a copy to half precision, each a
pass over the block and a kernel launch. On an H200 (docs/cuda/README.md) those passes run below the GPU's
bandwidth (64-row blocks leave most of the chip idle; a broadcast fp32 column makes torch's kernel a generic one),
and they are what keeps the loss at 1.25-1.9x DeepSpeed ALST's time. Here the same arithmetic runs as one reduction
and one pointwise kernel over the whole chunk, reading the half-precision logits and writing the half-precision
gradient in place, with no fp32 [rows, V] buffer at all.

The arithmetic is loss.py's, operation for operation (aten's `log_softmax`: ``(x - max) - log(sum(exp(x - max)))``
in fp32; the gradient ``exp(log_probs) * scale`` plus ``-scale`` at the target, rounded once), so the results differ
from the eager blocks only where the compiled ``exp`` / ``log`` round differently in fp32
(tests/test_accelerator_paths.py bounds it). Used on CUDA where Triton is installed, outside torch.compile's own
tracing (a compiled model's loss is compiled with it); ``TRANSFORMERS_MST_FUSED_LOSS=0`` keeps the eager blocks. A
kernel that fails to compile is reported once and the eager blocks run instead.
"""

import functools
import os

import torch

from ..utils import logging


logger = logging.get_logger(__name__)

ENV_VAR = "TRANSFORMERS_MST_FUSED_LOSS"
# Devices whose loss runs these kernels (tests add "cpu" to run inductor's C++ kernels on this machine's CPU).
DEVICES = {"cuda"}
_failed = []  # the first compile error, once one happened: the eager blocks run from then on


def _env_enabled() -> bool:
    value = os.environ.get(ENV_VAR, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV_VAR}={value!r}: allowed 1 (the default: fused kernels on CUDA) or 0 (eager blocks)")
    return value == "1"


def applies(logits: torch.Tensor) -> bool:
    """Whether the loss of ``logits`` runs the fused kernels (see the module's docstring)."""
    if logits.device.type not in DEVICES or _failed or not _env_enabled() or torch.compiler.is_compiling():
        return False
    if logits.device.type == "cuda":
        from torch.utils._triton import has_triton

        return has_triton()
    return True


def _log_probs(logits):
    """fp32 log-probabilities of [C, V] ``logits`` as aten's `log_softmax` computes them (a compiled body only: the
    [C, V] fp32 values stay inside the kernels)."""
    shifted = logits.float() - logits.float().amax(-1, keepdim=True)
    return shifted - shifted.exp().sum(-1, keepdim=True).log()


def _log_prob_at_target(logits, safe_target):
    """[C] fp32: ``log_softmax(logits.float())`` at ``safe_target`` [C, 1]."""
    return _log_probs(logits).gather(1, safe_target).squeeze(1)


def _loss_grad_(logits, safe_target, scale):
    """`_log_prob_at_target`, and the loss's gradient written over ``logits``: ``exp(log_probs) * scale``, minus
    ``scale`` [C, 1] at the target, rounded once to the logits' dtype (loss.py's `_cross_entropy_sum_and_grad`)."""
    log_probs = _log_probs(logits)
    picked = log_probs.gather(1, safe_target).squeeze(1)
    columns = torch.arange(logits.shape[1], device=logits.device)
    grad = log_probs.exp() * scale + torch.where(columns == safe_target, -scale, 0.0)
    logits.copy_(grad)
    return picked


def _sliced_grad_(logits, shift, column, at_target, sign):
    """A vocabulary slice's gradient written over its [N, rows] ``logits`` (loss.py's `_VocabSlicedLMLossFunction`):
    ``exp(logits - shift)`` in fp32, plus ``at_target`` [N, 1] at ``column`` [N, 1], times ``sign``, rounded once."""
    columns = torch.arange(logits.shape[1], device=logits.device)
    part = torch.sub(logits, shift).exp() + torch.where(columns == column, at_target, 0.0)
    logits.copy_(part * sign)


@functools.cache
def _compiled(body):
    # dynamic: one kernel for every chunk, slice and vocabulary size (no recompile for the last, shorter chunk)
    return torch.compile(body, dynamic=True, fullgraph=True)


_FAILED = object()


def _run(body, *args):
    """``body(*args)`` compiled, or `_FAILED` (nothing ran) where it could not be compiled."""
    try:
        return _compiled(body)(*args)
    except Exception as error:  # a compiler or toolchain missing on this machine: eager from here on
        if _failed:
            raise
        _failed.append(error)
        logger.warning(
            f"mini-sequence LM-head loss: the fused kernels failed to compile ({type(error).__name__}: {error}); the "
            f"loss runs its eager row blocks from now on (as with {ENV_VAR}=0)."
        )
        return _FAILED


def log_prob_at_target(logits, safe_target):
    """`_log_prob_at_target` compiled, or None where it could not be (the caller runs its eager blocks)."""
    picked = _run(_log_prob_at_target, logits, safe_target)
    return None if picked is _FAILED else picked


def loss_grad_(logits, safe_target, scale):
    """`_loss_grad_` compiled (``logits`` then holds the gradient), or None with ``logits`` untouched."""
    picked = _run(_loss_grad_, logits, safe_target, scale)
    return None if picked is _FAILED else picked


def sliced_grad_(logits, shift, column, at_target, sign) -> bool:
    """`_sliced_grad_` compiled (``logits`` then holds the gradient); False, ``logits`` untouched, where it could not
    be."""
    return _run(_sliced_grad_, logits, shift, column, at_target, sign) is not _FAILED

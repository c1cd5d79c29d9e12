"""What the planner puts in place of the GPU-only parts of a training step, on fake tensors: a FlashAttention-like
attention (its memory, not its values; Ulysses' all-to-alls with sp > 1), flash-linear-attention's and mamba_ssm's
chunked recurrent kernels, and the per-rank work of ZeRO-2/3 (gradient sharding, parameter gathering) and of
layer-input offload (host copies counted, not held). They reach the runtime only through its extension points:
upstream's attention and mask interfaces (registered when a plan is built), the global names by which upstream's
modeling modules call their kernels (replaced while a step runs: `recurrent_kernels_like`), the attribute
streaming_backward/masks.py reads, the checkpointing function's offload tag (streaming_backward/offload.py) and, for
streamed layers under Ulysses, a ShardedSequenceMask as the layers' mask (mst_core/sharded_sequence.py)."""

import contextlib
import functools
import math
import sys
import weakref
from unittest import mock

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

from ..mst_core.sharded_sequence import ShardedSequenceMask
from ..streaming_backward import masks as streamed_masks


ATTENTION = "mst_planner"  # (a name containing "flash" would send upstream looking for a kernel)


def _empty_in_layout_of(tensor, shape):
    """An empty tensor of `shape` laid out in memory as `tensor` is: the queries are a [B, S, H, D] projection viewed
    as [B, H, S, D], and a kernel's output laid out so makes the callers' `.transpose(1, 2).contiguous()` free."""
    physical = sorted(range(tensor.dim()), key=lambda dim: -tensor.stride(dim))
    return torch.empty_permuted(shape, physical, dtype=tensor.dtype, device=tensor.device)


class _FlashLikeAttention(torch.autograd.Function):
    """Memory stand-in for a FlashAttention kernel: allocates its output and the log-sum-exp it
    keeps for backward, and in backward the three input gradients. The values are meaningless
    (planning runs on fake tensors); only the allocations matter."""

    @staticmethod
    def forward(ctx, query, key, value, sinks):
        out = _empty_in_layout_of(query, query.shape[:-1] + value.shape[-1:])  # MLA's values: another head size
        logsumexp = query.new_empty(query.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(query, key, value, out, logsumexp)
        ctx.sinks = sinks
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, _, _ = ctx.saved_tensors
        sinks_grad = None if ctx.sinks is None else torch.empty_like(ctx.sinks)
        return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value), sinks_grad


def _flash_like_attention(module, query, key, value, attention_mask, s_aux=None, **kwargs):
    # query [B, H, S, D], key/value [B, H_kv, S, D]; HF attention functions return [B, S, H, D]. GPT-OSS passes its
    # attention sinks [H] as s_aux: a kernel with sinks returns their gradient too (the streamed layer checks it).
    return _FlashLikeAttention.apply(query, key, value, s_aux).transpose(1, 2).contiguous(), None


# Streamed layers call it per query chunk with mask=None, as FlashAttention (bottom-right causal) is called.
setattr(_flash_like_attention, streamed_masks.BOTTOM_RIGHT_CAUSAL, True)




class _ChunkGatedDeltaRuleLike(torch.autograd.Function):
    """Memory stand-in for flash-linear-attention's chunked Gated DeltaNet (`fla/ops/gated_delta_rule/chunk.py`:
    `ChunkGatedDeltaRuleFunction`, its Triton kernels; read at fla commit bc3b101, 2026-08-22), which upstream's Gated
    DeltaNet layers call on a GPU where fla is installed, for every chunk of 64 tokens at once: its forward keeps the
    normalized q/k, the gates' cumulative sums and the solved intra-chunk matrices `A`; its backward recomputes every
    chunk's start state `h` ([B, chunks, heads, K, V], growing with the sequence) and writes their gradients `dh`
    beside them. Allocated here in fla's order and dtypes (Hopper's tiling: one partial gate gradient per 128 key
    columns); the values are meaningless. Upstream's reference scan, which the CPU runs, allocates otherwise and
    loops in Python over every 64 tokens (minutes per fake step)."""

    @staticmethod
    def forward(ctx, query, key, value, g, beta, initial_state, output_final_state, l2norm):
        q, k, v, g, beta = (t.contiguous() for t in (query, key, value, g, beta))  # fla's input_guard
        batch, length, _, k_dim = k.shape
        v_heads, v_dim = v.shape[2:]
        chunks = math.ceil(length / 64)
        q_rstd = k_rstd = None
        if l2norm:
            q, q_rstd = torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)
            k, k_rstd = torch.empty_like(k), k.new_empty(k.shape[:-1], dtype=torch.float32)
        g = torch.empty_like(g, dtype=torch.float32)  # the gates' cumulative sums within each chunk
        solved = k.new_empty(batch, length, v_heads, 64)  # A
        w, u = k.new_empty(batch, length, v_heads, k_dim), torch.empty_like(v)
        states, v_new = k.new_empty(batch, chunks, v_heads, k_dim, v_dim), torch.empty_like(u)  # h
        final = k.new_empty(batch, v_heads, k_dim, v_dim, dtype=torch.float32) if output_final_state else None
        out = torch.empty_like(v)
        del w, u, states, v_new
        ctx.save_for_backward(q, q_rstd, k, k_rstd, v, g, beta, solved, initial_state)
        return out, final

    @staticmethod
    def backward(ctx, grad_out, grad_final):
        q, q_rstd, k, k_rstd, v, g, beta, solved, initial_state = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        batch, length, heads, k_dim = k.shape
        v_heads, v_dim = v.shape[2:]
        chunks = math.ceil(length / 64)
        w, u = k.new_empty(batch, length, v_heads, k_dim), torch.empty_like(v)  # recomputed
        states, v_new = k.new_empty(batch, chunks, v_heads, k_dim, v_dim), torch.empty_like(u)  # recomputed
        dv = torch.empty_like(grad_out)
        dstates = q.new_empty(batch, chunks, v_heads, k_dim, v_dim)
        dinitial = None if initial_state is None else torch.empty_like(initial_state, dtype=torch.float32)
        dv = torch.empty_like(dv)
        dq, dk = q.new_empty(batch, length, v_heads, k_dim), k.new_empty(batch, length, v_heads, k_dim)
        dg = g.new_empty(math.ceil(k_dim / 128), *g.shape)
        dw = torch.empty_like(w)
        if heads != v_heads:  # grouped values: summed over each key head's value heads
            dq = q.new_empty(q.shape)
            dk = k.new_empty(k.shape)
        dg = g.new_empty(g.shape)
        dk2 = k.new_empty(batch, length, v_heads, k_dim)  # the intra-chunk matrices' backward
        dv_intra, db, dg2 = torch.empty_like(v), torch.empty_like(beta), torch.empty_like(g)
        if heads != v_heads:
            dk2 = k.new_empty(k.shape)
        dv = dv_intra
        dg = torch.empty_like(dg)  # the cumulative sums' backward
        del w, u, states, v_new, dstates, dw, dk2, dg2, dv_intra
        if q_rstd is not None:  # the l2 norms' backward
            dq, dk = torch.empty_like(q), torch.empty_like(k)
        return dq, dk, dv, dg, db, dinitial, None, None


def chunk_gated_delta_rule_like(query, key, value, g, beta, initial_state=None, output_final_state=False,
                                use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
    """`_ChunkGatedDeltaRuleLike` called as upstream calls `torch_chunk_gated_delta_rule` (fla's
    `chunk_gated_delta_rule` where it is installed)."""
    return _ChunkGatedDeltaRuleLike.apply(query, key, value, g, beta, initial_state, output_final_state,
                                          use_qk_l2norm_in_kernel)


# mamba_ssm (`mamba_ssm/ops/triton/ssd_combined.py`, read at commit e9594ce, 2026-07-23): what Mamba2's fused chunked
# scan allocates, for the stand-ins below. An H100 / H200 has 132 SMs, from which some backward kernels choose how many
# head splits to sum over.
GPU_SMS = 132


def _contiguous_rows(tensor):
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def _head_splits(batch, chunks, heads, groups):
    heads_per_group = heads // groups
    heads_per_program = max(min(math.ceil(batch * chunks * heads / GPU_SMS), heads_per_group), 1)
    return math.ceil(heads_per_group / heads_per_program)


def _mamba2_scan_forward(x, B, C, chunk_size, z, state_dtype):
    """The allocations of mamba_ssm's `_mamba_chunk_scan_combined_fwd`: the gates' chunk sums, every chunk's state
    (fp32 while summed, then in `state_dtype`), C.B per chunk, the output. Returns (out, out_x, final state)."""
    batch, length, heads, head_dim = x.shape
    groups, state = B.shape[2:]
    chunks = math.ceil(length / chunk_size)
    B, C = _contiguous_rows(B), _contiguous_rows(C)
    if x.stride(-1) != 1 and x.stride(1) != 1:
        x = x.contiguous()
    per_chunk = (batch, heads, chunks, chunk_size)
    dA_cumsum, dt = x.new_empty(per_chunk, dtype=torch.float32), x.new_empty(per_chunk, dtype=torch.float32)
    states = x.new_empty(batch, chunks, heads, head_dim, state, dtype=torch.float32)
    states, final = (x.new_empty(batch, chunks, heads, head_dim * state, dtype=state_dtype or C.dtype),
                     x.new_empty(batch, heads, head_dim, state, dtype=torch.float32))
    cb = x.new_empty(batch, chunks, groups, chunk_size, chunk_size, dtype=torch.float32)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    out_x = None if z is None else torch.empty_like(out)
    del dA_cumsum, dt, states, cb
    return out, out_x, final


def _mamba2_scan_backward(dout, x, dt, B, C, chunk_size, z, initial_states, dx=None, ddt=None, dB=None, dC=None,
                          dz=None, recompute_output=False):
    """The allocations of mamba_ssm's `_mamba_chunk_scan_combined_bwd`, which recomputes every chunk's state (fp32,
    then in x's dtype) and writes their gradients beside them; the gradients given (`dx`, ...: the fused layer's
    slices of one buffer) are written into. Workspaces of [B, heads, chunks] and smaller are left out. Returns
    (dx, ddt, dB, dC, dz, the initial state's gradient, the recomputed output or None)."""
    dout = _contiguous_rows(dout)
    batch, length, heads, head_dim = x.shape
    groups, state = B.shape[2:]
    chunks = math.ceil(length / chunk_size)
    per_chunk = (batch, heads, chunks, chunk_size)
    splits = _head_splits(batch, chunks, heads, groups)
    dB = torch.empty_like(B) if dB is None else dB
    dC = torch.empty_like(C) if dC is None else dC
    ddt = torch.empty_like(dt) if ddt is None else ddt
    dt_in = torch.empty_like(dt)  # dt.clone()
    dA_cumsum, dt32 = x.new_empty(per_chunk, dtype=torch.float32), x.new_empty(per_chunk, dtype=torch.float32)
    cb = x.new_empty(batch, chunks, groups, chunk_size, chunk_size, dtype=torch.float32)
    states = x.new_empty(batch, chunks, heads, head_dim, state, dtype=torch.float32)
    states = x.new_empty(batch, chunks, heads, head_dim * state, dtype=torch.float32)
    out_z = None
    if z is not None:
        dz = torch.empty_like(z) if dz is None else dz
        out_z = torch.empty_like(x) if recompute_output else None
        dout = torch.empty_like(dout)
    dstates = x.new_empty(batch, chunks, heads, head_dim, state, dtype=torch.float32)
    # Passed back through the chunks: in x's dtype, and the states converted to it.
    dstates, states, dinitial = (x.new_empty(batch, chunks, heads, head_dim * state),
                                 x.new_empty(batch, chunks, heads, head_dim * state),
                                 None if initial_states is None else x.new_empty(batch, heads, head_dim, state))
    dx = torch.empty_like(x) if dx is None else dx
    ddt32 = x.new_empty(per_chunk, dtype=torch.float32)
    ddA_next = x.new_empty(per_chunk, dtype=torch.float32)
    dB32 = x.new_empty(batch, length, splits, groups, state, dtype=torch.float32)
    dB32 = dB32.new_empty(batch, length, groups, state)  # summed over the splits
    ddA_prev = x.new_empty(per_chunk, dtype=torch.float32)
    dC32 = x.new_empty(batch, length, splits, groups, state, dtype=torch.float32)
    dC32 = dC32.new_empty(batch, length, groups, state)
    dcb = x.new_empty(batch, chunks, splits, groups, chunk_size, chunk_size, dtype=torch.float32)
    dcb = dcb.new_empty(batch, chunks, groups, chunk_size, chunk_size)
    ddA_prev = torch.empty_like(ddA_prev)  # .flip().cumsum().flip(): three passes, one live at a time
    ddA_prev = torch.empty_like(ddA_prev)
    ddA = x.new_empty(per_chunk, dtype=torch.float32)
    del dt_in, dA_cumsum, dt32, cb, states, dstates, ddt32, ddA_next, dB32, ddA_prev, dC32, dcb, ddA
    return dx, ddt, dB, dC, dz, dinitial, out_z


class _Mamba2ChunkScanLike(torch.autograd.Function):
    """Memory stand-in for mamba_ssm's `mamba_chunk_scan_combined` (`MambaChunkScanCombinedFn`), which upstream's
    Mamba2 mixers call where a cache is given (a streamed chunk: the state it starts from, and its end state); the
    values are meaningless."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, D, z, dt_bias, initial_states, chunk_size, final_state_wanted, state_dtype):
        out, out_x, final = _mamba2_scan_forward(x, B, C, chunk_size, z, state_dtype)
        ctx.save_for_backward(out if z is None else out_x, x, dt, A, B, C, D, z, dt_bias, initial_states)
        ctx.chunk_size = chunk_size
        return out, final if final_state_wanted else None

    @staticmethod
    def backward(ctx, dout, dfinal):
        _, x, dt, A, B, C, D, z, dt_bias, initial_states = ctx.saved_tensors
        dx, ddt, dB, dC, dz, dinitial, _ = _mamba2_scan_backward(dout, x, dt, B, C, ctx.chunk_size, z, initial_states)
        dA, dD = torch.empty_like(A), None if D is None else torch.empty_like(D)
        ddt_bias = None if dt_bias is None else torch.empty_like(dt_bias)
        dinitial = None if dinitial is None else dinitial.to(initial_states.dtype)
        return dx, ddt, dA, dB, dC, dD, dz, ddt_bias, dinitial, None, None, None


def mamba2_chunk_scan_like(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None,
                           dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, z=None,
                           state_dtype=None, **kwargs):
    """`_Mamba2ChunkScanLike` called as upstream calls `mamba2_chunk_scan` (mamba_ssm's `mamba_chunk_scan_combined`
    where it is installed)."""
    out, final = _Mamba2ChunkScanLike.apply(hidden_states, dt, A, B, C, D, z, dt_bias, initial_states, chunk_size,
                                            return_final_states, state_dtype)
    return (out, final) if return_final_states else out


class _Mamba2SplitConvScanLike(torch.autograd.Function):
    """Memory stand-in for mamba_ssm's `mamba_split_conv1d_scan_combined` (`MambaSplitConv1dScanCombinedFn`), the
    whole mixer after its input projection (causal convolution, chunked scan, gated RMS norm or gating by z, output
    projection), which upstream's Mamba2 mixers call in training without a cache (an unstreamed layer). It keeps the
    projected input, the scan's output and the norm's reciprocal deviations, and recomputes the rest in its backward;
    the values are meaningless."""

    @staticmethod
    def _views(zxbcdt, conv_out, heads, head_dim, groups, state):
        """z (the gate), and x, B, C of the convolution's output, as mamba_ssm splits them."""
        batch, length, _ = zxbcdt.shape
        inner = heads * head_dim
        z = zxbcdt[..., :inner].view(batch, length, heads, head_dim)
        x = conv_out[..., :inner].view(batch, length, heads, head_dim)
        B = conv_out[..., inner:inner + groups * state].view(batch, length, groups, state)
        C = conv_out[..., inner + groups * state:].view(batch, length, groups, state)
        return z, x, B, C

    @staticmethod
    def forward(ctx, zxbcdt, conv_weight, conv_bias, dt_bias, A, D, norm_weight, out_weight, out_bias, chunk_size,
                head_dim, groups):
        batch, length, _ = zxbcdt.shape
        heads = D.shape[0]
        inner = heads * head_dim
        state = (conv_weight.shape[0] - inner) // groups // 2
        conv_out = zxbcdt.new_empty(batch, length, inner + 2 * groups * state)  # the causal convolution
        z, x, B, C = _Mamba2SplitConvScanLike._views(zxbcdt, conv_out, heads, head_dim, groups, state)
        rstd = None
        if norm_weight is None:  # the scan gates its output by z itself
            normed, scanned, _ = _mamba2_scan_forward(x, B, C, chunk_size, z, None)
        else:
            scanned, _, _ = _mamba2_scan_forward(x, B, C, chunk_size, None, None)
            rstd = zxbcdt.new_empty(batch * length * groups, dtype=torch.float32)  # the gated RMS norm, per group
            normed = zxbcdt.new_empty(batch, length, inner)
        out = normed.view(batch, length, inner) @ out_weight.t()  # the output projection
        del conv_out, z, x, B, C, normed
        ctx.save_for_backward(zxbcdt, conv_weight, conv_bias, scanned, A, D, dt_bias, norm_weight, rstd, out_weight,
                              out_bias)
        ctx.chunk_size, ctx.head_dim, ctx.groups = chunk_size, head_dim, groups
        return out if out_bias is None else out + out_bias

    @staticmethod
    def backward(ctx, dout):
        zxbcdt, conv_weight, conv_bias, _, A, D, dt_bias, norm_weight, _, out_weight, out_bias = ctx.saved_tensors
        batch, length, _ = zxbcdt.shape
        heads, head_dim, groups = D.shape[0], ctx.head_dim, ctx.groups
        inner = heads * head_dim
        state = (conv_weight.shape[0] - inner) // groups // 2
        out_recomputed = zxbcdt.new_empty(batch, length, inner)
        conv_out = zxbcdt.new_empty(batch, length, inner + 2 * groups * state)  # recomputed
        z, x, B, C = _Mamba2SplitConvScanLike._views(zxbcdt, conv_out, heads, head_dim, groups, state)
        dzxbcdt = torch.empty_like(zxbcdt)
        d_conv_out = torch.empty_like(conv_out)
        dz, dx, dB, dC = _Mamba2SplitConvScanLike._views(dzxbcdt, d_conv_out, heads, head_dim, groups, state)
        ddt, dt = dzxbcdt[..., -heads:], zxbcdt[..., -heads:]
        d_scan = dout @ out_weight  # through the output projection
        out_for_linear = out_recomputed
        if norm_weight is None:  # the scan's backward recomputes the gated output itself
            out_for_linear = _mamba2_scan_backward(d_scan.view(batch, length, heads, head_dim), x, dt, B, C,
                                                   ctx.chunk_size, z, None, dx=dx, ddt=ddt, dB=dB, dC=dC, dz=dz,
                                                   recompute_output=True)[-1].view(batch, length, inner)
        else:
            d_scan = torch.empty_like(d_scan)  # the gated RMS norm's backward (it writes z's gradient in place)
            _mamba2_scan_backward(d_scan.view(batch, length, heads, head_dim), x, dt, B, C, ctx.chunk_size, None,
                                  None, dx=dx, ddt=ddt, dB=dB, dC=dC)
        d_out_weight = dout.flatten(0, -2).t() @ out_for_linear.flatten(0, -2)
        del d_scan, conv_out, z, x, B, C, out_recomputed, out_for_linear
        d_conv_bias = None if conv_bias is None else torch.empty_like(conv_bias)
        d_out_bias = None if out_bias is None else torch.empty_like(out_bias)
        d_norm_weight = None if norm_weight is None else torch.empty_like(norm_weight)
        # The causal convolution's backward writes x's, B's and C's input gradients into dzxbcdt.
        del d_conv_out, dz, dx, dB, dC, ddt
        return (dzxbcdt, torch.empty_like(conv_weight), d_conv_bias, torch.empty_like(dt_bias), torch.empty_like(A),
                torch.empty_like(D), d_norm_weight, d_out_weight.to(out_weight.dtype), d_out_bias, None, None, None)


def mamba2_split_conv1d_scan_combined_like(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size,
                                           initial_states=None, dt_limit=(0.0, float("inf")),
                                           return_final_states=False, activation="silu", rmsnorm_weight=None,
                                           rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None, headdim=None,
                                           ngroups=1, norm_before_gate=True, **kwargs):
    """`_Mamba2SplitConvScanLike` called as upstream calls `mamba2_split_conv1d_scan_combined` (whose torch fallback
    returns None: upstream's mixer then runs unfused)."""
    if outproj_weight is None or initial_states is not None or return_final_states:
        raise NotImplementedError("planner: a fused Mamba2 mixer call without its output projection, or with states, "
                                  "has no stand-in")
    return _Mamba2SplitConvScanLike.apply(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, rmsnorm_weight,
                                          outproj_weight, outproj_bias, chunk_size, headdim, ngroups)


# mamba_ssm's selective scan (`mamba_ssm/ops/selective_scan_interface.py`, `SelectiveScanFn` and `MambaInnerFn`, read at
# commit 01887ed) and causal-conv1d's convolution (`causal_conv1d_interface.py`, `CausalConv1dFn`, read at commit
# 17f4f2f), which Mamba (v1) mixers call on a GPU where they are installed (Mamba, FalconMamba, Jamba). The scan's CUDA
# kernel runs the sequence in chunks of 2048 tokens and keeps each chunk's end state for its backward: [B, D, chunks,
# 2 N] in fp32 (N: the state size).
SELECTIVE_SCAN_CHUNK = 2048


def _scan_states(u, state_size):
    batch, dim, length = u.shape
    return u.new_empty(batch, dim, math.ceil(length / SELECTIVE_SCAN_CHUNK), 2 * state_size, dtype=torch.float32)


def _selective_scan_backward_grads(u, delta, A, B, C, D, z, delta_bias):
    """What the scan's backward kernel allocates: the inputs' gradients, those of B, C, A, D and the delta bias in fp32
    (summed over channels or tokens), which autograd then casts to their inputs' dtypes."""
    du, ddelta = torch.empty_like(u), torch.empty_like(delta)
    dA = torch.empty_like(A, dtype=torch.float32)
    dB, dC = (torch.empty_like(t, dtype=torch.float32) for t in (B, C))
    dD = None if D is None else torch.empty_like(D, dtype=torch.float32)
    dz = None if z is None else torch.empty_like(z)
    ddelta_bias = None if delta_bias is None else torch.empty_like(delta_bias, dtype=torch.float32)
    return du, ddelta, dA, dB, dC, dD, dz, ddelta_bias


class _SelectiveScanLike(torch.autograd.Function):
    """Memory stand-in for mamba_ssm's `selective_scan_fn` (upstream's `mamba_selective_scan`): it keeps its inputs (u,
    delta, B and C copied where their rows are not contiguous), the chunks' end states and, gated by z, its ungated
    output; the values are meaningless."""

    @staticmethod
    def forward(ctx, u, delta, A, B, C, D, z, delta_bias, last_state_wanted):
        u, delta, B, C = (_contiguous_rows(t) for t in (u, delta, B, C))
        z = None if z is None else _contiguous_rows(z)
        states = _scan_states(u, A.shape[-1])
        out = torch.empty_like(u, memory_format=torch.contiguous_format)
        ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, states, None if z is None else out)
        gated = out if z is None else torch.empty_like(out)
        return gated, states[:, :, -1, 1::2] if last_state_wanted else None

    @staticmethod
    def backward(ctx, dout, dlast):
        u, delta, A, B, C, D, z, delta_bias, _, _ = ctx.saved_tensors
        return (*_selective_scan_backward_grads(u, delta, A, B, C, D, z, delta_bias), None)


def mamba_selective_scan_like(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                              return_last_state=False, **kwargs):
    """`_SelectiveScanLike` called as upstream calls `mamba_selective_scan` (B and C as [B, N, L])."""
    out, last = _SelectiveScanLike.apply(hidden_states, dt, A, B, C, D, z, delta_bias, return_last_state)
    return (out, last) if return_last_state else out


class _CausalConv1dLike(torch.autograd.Function):
    """Memory stand-in for causal-conv1d's `causal_conv1d_fn`: it keeps its input (copied where neither its channels nor
    its tokens are contiguous) and returns the activated output; its backward allocates the input's gradient and the
    weight's and bias's in fp32. The values are meaningless."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        if x.stride(2) != 1 and x.stride(1) != 1:
            x = x.contiguous()
        ctx.save_for_backward(x, weight, bias)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, dout):
        x, weight, bias = ctx.saved_tensors
        dbias = None if bias is None else torch.empty_like(bias, dtype=torch.float32)
        return torch.empty_like(x), torch.empty_like(weight, dtype=torch.float32), dbias


def causal_conv1d_fn_like(x, weight, bias=None, activation=None, **kwargs):
    """`_CausalConv1dLike` called as upstream's Mamba (v1) mixers call `causal_conv1d_fn` (x: [B, D, L])."""
    return _CausalConv1dLike.apply(x, weight, bias)


class _MambaInnerLike(torch.autograd.Function):
    """Memory stand-in for mamba_ssm's `mamba_inner_fn`, a Mamba (v1) mixer after its input projection (convolution,
    x/dt projections, selective scan gated by z, output projection), which upstream's Mamba and FalconMamba mixers
    call in training without a cache (an unstreamed layer). It keeps the projected input, x's projection, B and C,
    the scan's chunk states and its ungated output, and recomputes the convolution and delta in its backward
    (checkpoint level 1); the values are meaningless."""

    @staticmethod
    def forward(ctx, xz, conv_weight, conv_bias, x_proj_weight, dt_proj_weight, out_proj_weight, out_proj_bias, A, D,
                delta_bias):
        batch, double_dim, length = xz.shape
        dim, state, rank = double_dim // 2, A.shape[-1], dt_proj_weight.shape[1]
        xz = _contiguous_rows(xz)
        conv_out = xz.new_empty(batch, dim, length)
        x_dbl = xz.new_empty(batch * length, rank + 2 * state)
        delta = xz.new_empty(batch, dim, length)
        B, C = (xz.new_empty(batch, 1, state, length) for _ in range(2))
        states = _scan_states(conv_out, state)
        out, out_z = torch.empty_like(conv_out), torch.empty_like(conv_out)
        del conv_out, delta
        ctx.save_for_backward(xz, conv_weight, conv_bias, x_dbl, x_proj_weight, dt_proj_weight, out_proj_weight, A, B,
                              C, D, delta_bias, states, out)
        ctx.has_out_bias = out_proj_bias is not None
        result = out_z.transpose(1, 2) @ out_proj_weight.t()
        return result if out_proj_bias is None else result + out_proj_bias

    @staticmethod
    def backward(ctx, dout):
        (xz, conv_weight, conv_bias, x_dbl, x_proj_weight, dt_proj_weight, out_proj_weight, A, B, C, D, delta_bias, _,
         _) = ctx.saved_tensors
        batch, double_dim, length = xz.shape
        conv_out, delta = (xz.new_empty(batch, double_dim // 2, length) for _ in range(2))  # recomputed
        dxz = torch.empty_like(xz)
        dout_y = xz.new_empty(batch, double_dim // 2, length)
        dconv_out, ddelta, dA, dB, dC, dD, _, ddelta_bias = _selective_scan_backward_grads(
            conv_out, delta, A, B, C, D, None, delta_bias)
        out_z = torch.empty_like(conv_out)  # recomputed for the output projection's weight gradient
        grads = [torch.empty_like(t) for t in (out_proj_weight, x_dbl, x_proj_weight, dt_proj_weight)]
        del conv_out, delta, dout_y, dconv_out, ddelta, dB, dC, out_z
        d_out_proj, _, d_x_proj, d_dt_proj = grads
        dconv_weight = torch.empty_like(conv_weight, dtype=torch.float32)
        dconv_bias = None if conv_bias is None else torch.empty_like(conv_bias, dtype=torch.float32)
        dout_bias = torch.empty_like(out_proj_weight[:, 0]) if ctx.has_out_bias else None
        return dxz, dconv_weight, dconv_bias, d_x_proj, d_dt_proj, d_out_proj, dout_bias, dA, dD, ddelta_bias


def mamba_inner_fn_like(xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight, out_proj_weight,
                        out_proj_bias, A, B=None, C=None, D=None, delta_bias=None, delta_softplus=True, **kwargs):
    """`_MambaInnerLike` called as upstream's Mamba and FalconMamba mixers call `mamba_inner_fn` (input-dependent B
    and C; FalconMamba's norms of B, C and dt are inside the kernel)."""
    if B is not None or C is not None:
        raise NotImplementedError("planner: a Mamba mixer with fixed B or C has no stand-in")
    return _MambaInnerLike.apply(xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight, out_proj_weight,
                                 out_proj_bias, A, D, delta_bias)


class _AdjointScanLike(torch.autograd.Function):
    """Memory stand-in for our selective scan (adjoint_sharding/scan.py `AdjointSelectiveScan`), which a streamed Mamba
    (v1) chunk runs from its carried state (mamba_ssm's takes none), in shards. Its forward keeps its inputs and the
    state entering each shard ([shards, B, D, N] fp32) and returns its fp32 output cast to the input's dtype. Each
    shard's working set, [shard, B, D, N] fp32 tensors (3 in the forward: the discretized terms and the states; 8 at
    once in the backward, with the adjoints and their flipped copies: the real scan's peak on fake tensors,
    tests/test_plan.py), lives only while that shard is scanned: allocated here once, in place of
    the loop over the shards that makes the scan slow on fake tensors (minutes per step). The values are
    meaningless."""

    @staticmethod
    def forward(ctx, u, dt, A, B, C, delta_bias, initial_state, shard, truncation, softplus, link=None):
        batch, dim, length = u.shape
        working = (min(shard, length), batch, dim, A.shape[-1])
        y = u.new_empty(batch, dim, length, dtype=torch.float32)
        shard_tensors = [u.new_empty(working, dtype=torch.float32) for _ in range(3)]
        del shard_tensors
        entering = u.new_empty(math.ceil(length / shard), batch, dim, A.shape[-1], dtype=torch.float32)
        ctx.save_for_backward(u, dt, A, B, C, delta_bias, entering)
        ctx.working, ctx.initial_dtype = working, None if initial_state is None else initial_state.dtype
        return y.to(u.dtype), u.new_empty(batch, dim, A.shape[-1], dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad_y, grad_last):
        u, dt, A, B, C, delta_bias, _ = ctx.saved_tensors
        grad_u, grad_dt, grad_B, grad_C = (torch.empty(t.shape, dtype=torch.float32, device=u.device)
                                           for t in (u, dt, B, C))
        grad_y = grad_y.float()
        shard_tensors = [u.new_empty(ctx.working, dtype=torch.float32) for _ in range(8)]
        del shard_tensors, grad_y
        grad_bias = None if delta_bias is None else torch.empty_like(delta_bias, dtype=torch.float32)
        grad_initial = None if ctx.initial_dtype is None else u.new_empty(ctx.working[1:], dtype=ctx.initial_dtype)
        return (grad_u.to(u.dtype), grad_dt.to(dt.dtype), torch.empty_like(A), grad_B.to(B.dtype),
                grad_C.to(C.dtype), None if grad_bias is None else grad_bias.to(delta_bias.dtype), grad_initial,
                None, None, None, None)


def _send_buffer(tensor):
    """The transient contiguous copy an all-to-all sends from (allocated, then dropped at once)."""
    return torch.empty_like(tensor, memory_format=torch.contiguous_format)


class _UlyssesFlashLikeAttention(torch.autograd.Function):
    """Memory stand-in for DeepSpeed-Ulysses around a FlashAttention kernel, on one rank of `sp`.

    The rank enters with its S/sp tokens for all heads, query [B, H, S/sp, D] and key/value
    [B, H_kv, S/sp, D]. An all-to-all turns each into the whole sequence for its share of the
    heads, [B, H/sp, S, D] (key/value: H_kv/sp heads, or one replicated head when H_kv < sp);
    the kernel keeps those, its output and a [B, H/sp, S] fp32 log-sum-exp for backward; a
    second all-to-all returns the output as [B, H, S/sp, D]. Backward mirrors it: the output
    gradient goes to [B, H/sp, S, D], the kernel makes the three input gradients there, and
    all-to-alls bring them back to the rank's tokens. Each all-to-all also allocates one
    transient send buffer of its input's size. Values are meaningless; only allocations matter."""

    @staticmethod
    def forward(ctx, query, key, value, sp):
        ctx.sp, ctx.shapes = sp, (query.shape, key.shape)
        gathered = []
        for t in (query, key, value):
            b, h, s, d = t.shape
            _send_buffer(t)
            gathered.append(t.new_empty(b, max(h // sp, 1), s * sp, d))
        q, k, v = gathered
        out_heads = q.new_empty(q.shape[:-1] + v.shape[-1:])
        logsumexp = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out_heads, logsumexp)
        _send_buffer(out_heads)
        return query.new_empty(query.shape[:-1] + value.shape[-1:])

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out_heads, _ = ctx.saved_tensors
        _send_buffer(grad_out)
        grad_heads = torch.empty_like(out_heads)  # the output gradient for this rank's heads, whole sequence
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        del grad_heads  # the kernel is done with it
        query_shape, kv_shape = ctx.shapes
        grads = []
        for g, shape in ((dq, query_shape), (dk, kv_shape), (dv, kv_shape)):
            _send_buffer(g)
            grads.append(g.new_empty(shape))
        del dq, dk, dv
        return (*grads, None)


def _ulysses_attention(module, query, key, value, attention_mask, sp, **kwargs):
    if isinstance(attention_mask, _PlannedQueryChunk):  # a streamed layer's query chunk, the keys already gathered
        return _UlyssesStreamedChunk.apply(query, key, value, sp).transpose(1, 2).contiguous(), None
    return _UlyssesFlashLikeAttention.apply(query, key, value, sp).transpose(1, 2).contiguous(), None


class _ExchangeHeads(torch.autograd.Function):
    """Memory stand-in for an all-to-all between [B, H, L, D] (one shard, all heads) and [B, H/sp, sp L, D] (the
    whole sequence, a share of the heads), either way (`to_sequence`); its backward is the other way. Each way
    allocates a send buffer and the result (ulysses/exchange.py: heads_to_sequence, sequence_to_heads)."""

    @staticmethod
    def forward(ctx, tensor, sp, to_sequence):
        ctx.sp, ctx.to_sequence = sp, to_sequence
        return _exchanged(tensor, sp, to_sequence)

    @staticmethod
    def backward(ctx, grad):
        return _exchanged(grad, ctx.sp, not ctx.to_sequence), None, None


def _exchanged(tensor, sp, to_sequence):
    b, h, s, d = tensor.shape
    _send_buffer(tensor)
    return tensor.new_empty((b, h // sp, s * sp, d) if to_sequence else (b, h * sp, s // sp, d))


class _GatherSequence(torch.autograd.Function):
    """Memory stand-in for an all-gather of [B, 1, L, D] into [B, 1, sp L, D] (ulysses/exchange.py: gather_sequence);
    its backward, a reduce-scatter, allocates one shard's gradient."""

    @staticmethod
    def forward(ctx, tensor, sp):
        ctx.sp = sp
        b, h, s, d = tensor.shape
        return tensor.new_empty((b, h, s * sp, d))

    @staticmethod
    def backward(ctx, grad):
        b, h, s, d = grad.shape
        return grad.new_empty((b, h, s // ctx.sp, d)), None


class _UlyssesStreamedChunk(torch.autograd.Function):
    """Memory stand-in for a streamed layer's query chunk under Ulysses (ulysses/streamed.py): the chunk's queries
    [B, H, C, D] go to [B, H/sp, sp C, D] (every shard's rows of the chunk), attend (a FlashAttention kernel per
    shard's block: outputs and log-sum-exps) to the gathered keys/values [B, H_kv/sp, S, D], and the output comes
    back to [B, H, C, D]. Backward: the three gradients, the keys'/values' for the whole gathered sequence."""

    @staticmethod
    def forward(ctx, query, keys, values, sp):
        ctx.sp = sp
        if keys.shape[1] == query.shape[1]:  # every head's keys (latents gathered): the chunk's own rows, no exchange
            ctx.sp = 1
            return _FlashLikeAttention.forward(ctx, query, keys, values, None)
        blocks = _exchanged(query, sp, True)
        out_heads = blocks.new_empty(blocks.shape[:-1] + values.shape[-1:])
        logsumexp = blocks.new_empty(blocks.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(blocks, keys, values, out_heads, logsumexp)
        return _exchanged(out_heads, sp, False)

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.sp == 1:
            return (*_FlashLikeAttention.backward(ctx, grad_out)[:3], None)
        blocks, keys, values, _, _ = ctx.saved_tensors
        grad_heads = _exchanged(grad_out, ctx.sp, True)
        grad_blocks, grad_keys, grad_values = torch.empty_like(blocks), torch.empty_like(keys), torch.empty_like(values)
        del grad_heads
        return _exchanged(grad_blocks, ctx.sp, False), grad_keys, grad_values, None


class _PlannedQueryChunk:
    """The attention mask a streamed layer passes per query chunk (ShardedSequenceMask.query_chunk)."""


class _PlannedShard(ShardedSequenceMask):
    """Stand-in for ulysses/masks.py's UlyssesMask: what a decoder layer gets as its mask on one rank of `sp` (a plainly
    causal sequence: no whole-sequence mask tensor is rebuilt)."""

    def __init__(self, sp, q_length):
        self.world_size, self.q_length, self.first_token = sp, q_length, 0
        self.latents = False  # whether the last `gather_keys_values` gathered latents

    def check_streamable(self, attention_module):
        pass  # the heads' divisibility is checked with the parallel settings (plan.py: check_parallel)

    def gather_keys_values(self, keys, values):
        self.latents = keys.shape[1] == values.shape[1] == 1  # latent attention: all-gathered (ulysses/masks.py)
        if self.latents:
            return _GatherSequence.apply(keys, self.world_size), _GatherSequence.apply(values, self.world_size)
        return _ExchangeHeads.apply(keys, self.world_size, True), _ExchangeHeads.apply(values, self.world_size, True)

    def scatter_grad(self, grad):
        if self.latents:
            return grad.new_empty(grad.shape[:2] + (grad.shape[2] // self.world_size,) + grad.shape[3:])
        return _exchanged(grad, self.world_size, False)

    def query_chunk(self, start, end, position_ids, causal_bias):
        return _PlannedQueryChunk()


def _sharded_mask(sp):
    def mask_function(*args, **kwargs):
        return _PlannedShard(sp, kwargs["q_length"])

    return mask_function


def attention_name(sp, streamed=False):
    """The planner's attention for sequence-parallel degree `sp`, registered with upstream's attention and mask
    interfaces on first use (importing the planner registers nothing). With sp > 1 and `streamed`, the layers' mask
    is a `_PlannedShard`, which a streamed layer reads as ulysses/masks.py's (mst_core/sharded_sequence.py)."""
    name = ATTENTION if sp == 1 else f"{ATTENTION}_ulysses{sp}" + ("_streamed" if streamed else "")
    if name not in AttentionInterface._global_mapping:
        attention = _flash_like_attention if sp == 1 else functools.partial(_ulysses_attention, sp=sp)
        AttentionInterface.register(name, attention)
        # no mask tensor without padding
        AttentionMaskInterface.register(name, _sharded_mask(sp) if sp > 1 and streamed else flash_attention_mask)
    return name


class StepHooks:
    """Per-rank work the planner adds to a fake step for ZeRO-2/3 and layer-input offload."""

    def __init__(self, parallel):
        self.parallel = parallel
        self.grad_shards = []  # ZeRO-2/3: this rank's 1/N partition of each reduced gradient
        self.gathered_forward = None  # ZeRO-3: the full parameters of the module running forward
        self.gathered_backward = (None, None)  # ZeRO-3: (module, full parameters) of the module in backward
        self.host_bytes = 0  # layer inputs in host memory now
        self.host_peak_bytes = 0
        self.host_window_peak = 0  # since the current phase began (layer_phases.py)

    def add_host(self, nbytes):
        self.host_bytes += nbytes
        self.host_peak_bytes = max(self.host_peak_bytes, self.host_bytes)
        self.host_window_peak = max(self.host_window_peak, self.host_bytes)

    def shard_gradient(self, param):
        # ZeRO-2/3: the full gradient is reduce-scattered and freed; this rank keeps its partition.
        self.grad_shards.append(param.grad.new_empty(math.ceil(param.numel() / self.parallel.gpus)))
        param.grad = None

    def gather_for_forward(self, module, args):
        if self.gathered_backward[0] is not module:  # still gathered if its backward began (recompute)
            self.gathered_forward = _gather(module)

    def release_after_forward(self, module, args, output):
        self.gathered_forward = None
        if isinstance(output, torch.Tensor) and output.grad_fn is not None:
            # When the gradient reaches the module's output (its backward starts), its parameters are gathered again
            # and those of the module before it in backward are released. A hook on the output's node, not an
            # identity Function after it: that would return a view, which Llama-4's MoE block adds into in place.
            output.grad_fn.register_prehook(functools.partial(self._gather_for_backward, module))
        return output

    def _gather_for_backward(self, module, grad_outputs):
        if self.gathered_backward[0] is not module:
            self.gathered_backward = (None, None)  # release first, as the previous module's backward is done
            self.gathered_backward = (module, _gather(module))

    # --offload inputs for streamed layers: stand-in for the library's streaming_backward/offload.py HostStorage. The input's
    # host copy holds no bytes here (counted as host memory until the layer's backward is done with it);
    # each chunk the backward reads back is allocated on the GPU.
    def save(self, x):
        nbytes = x.numel() * x.element_size()
        saved = _HostCopy(x.shape, x.dtype)
        self.add_host(nbytes)
        weakref.finalize(saved, self._free_host, nbytes)
        return saved

    def _free_host(self, nbytes):
        self.add_host(-nbytes)

    def load(self, saved, start, end, device):
        return torch.empty((saved.shape[0], end - start, *saved.shape[2:]), dtype=saved.dtype, device=device)

    def saved_tensors_hooks(self):
        """--offload inputs where the streamed layers run nested checkpoints (ZeRO-3): stand-in for torch's
        `save_on_cpu`, which the library puts them under (streaming_backward/offload.py): every tensor autograd saves
        is counted as host memory while saved (its device copy freed unless something else holds it) and comes back
        as a new device tensor when the backward unpacks it."""

        def pack(tensor):
            nbytes = tensor.numel() * tensor.element_size()
            saved = _HostCopy(tensor.shape, tensor.dtype, tensor.device)
            self.add_host(nbytes)
            weakref.finalize(saved, self._free_host, nbytes)
            return saved

        def unpack(saved):
            return torch.empty(saved.shape, dtype=saved.dtype, device=saved.device)

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


class _HostCopy:
    """What the planner's host storage keeps of a streamed layer's input: its shape and dtype."""

    def __init__(self, shape, dtype, device=None):
        self.shape, self.dtype, self.device = shape, dtype, device


def _gather(module):
    """A buffer of the bytes of `module`'s own parameters in full (what a ZeRO-3 all-gather fills)."""
    nbytes = sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
    return next(module.parameters(recurse=False)).new_empty(nbytes, dtype=torch.uint8)


class _OffloadedCheckpoint(torch.autograd.Function):
    """Gradient checkpointing of one decoder layer whose input moves to host memory in forward.

    Forward runs the layer without keeping anything on the GPU (the input [S/sp, d] goes to the
    host); backward brings it back (one buffer in use, one more in flight for the layer before:
    prefetch), recomputes the layer and backpropagates through it, parameters' gradients included."""

    @staticmethod
    def forward(ctx, hooks, run, hidden):
        ctx.hooks, ctx.run, ctx.meta = hooks, run, (hidden.shape, hidden.dtype)
        ctx.nbytes = hidden.numel() * hidden.element_size()
        hooks.add_host(ctx.nbytes)
        return run(hidden)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype = ctx.meta
        hidden = grad.new_empty(shape, dtype=dtype).requires_grad_()  # copied back from the host
        prefetch = grad.new_empty(shape, dtype=dtype)  # noqa: F841  (the previous layer's input, in flight)
        ctx.hooks.add_host(-ctx.nbytes)
        with torch.enable_grad():
            out = ctx.run(hidden)
        torch.autograd.backward(out, grad)
        return None, None, hidden.grad


def offloaded_checkpoint(hooks, function, *args):
    """Stand-in for a layer's `_gradient_checkpointing_func`: args is (hidden_states,)."""
    if len(args) != 1 or not isinstance(args[0], torch.Tensor):
        raise RuntimeError("planner: layer-input offload expects a decoder layer called with hidden_states only")
    return _OffloadedCheckpoint.apply(hooks, function, args[0])


# Upstream's modeling modules call their scans by these global names, which they resolve when imported to a GPU
# package's kernel where it is installed (`use_kernel_func_from_hub_with_fallback`), else to their torch path.
KERNEL_STANDINS = {"torch_chunk_gated_delta_rule": "chunk_gated_delta_rule_like",  # fla
                   "mamba2_chunk_scan": "mamba2_chunk_scan_like",  # mamba_ssm
                   "mamba2_split_conv1d_scan_combined": "mamba2_split_conv1d_scan_combined_like",
                   "mamba_selective_scan": "mamba_selective_scan_like",  # mamba_ssm, Mamba (v1) mixers
                   "mamba_inner_fn": "mamba_inner_fn_like"}
# In the modules of Mamba (v1) mixers (those with `mamba_selective_scan`) also their convolution (causal-conv1d);
# elsewhere upstream's torch path runs it (docs/planner.md).
MAMBA_V1_STANDINS = {"causal_conv1d_fn": "causal_conv1d_fn_like"}


@contextlib.contextmanager
def recurrent_kernels_like(model):
    """Inside the block, `model`'s Gated DeltaNet, Mamba2 and Mamba (v1) layers call the stand-ins of the GPU kernels
    upstream takes where fla, mamba_ssm and causal-conv1d are installed (`KERNEL_STANDINS`, `MAMBA_V1_STANDINS`), not
    upstream's torch paths, and our selective scan's stand-in (`_AdjointScanLike`)."""
    from ..adjoint_sharding import scan

    modules = {sys.modules[type(m).__module__] for m in model.modules()}
    with contextlib.ExitStack() as stack:
        # Our scan's Function, which streamed Mamba (v1) chunks (and adjoint sharding) run on a GPU too; its caller
        # (`scan.selective_scan`: the D skip and the gate) runs as it is.
        stack.enter_context(mock.patch.object(scan, "AdjointSelectiveScan", _AdjointScanLike))
        for module in modules:
            standins = {**KERNEL_STANDINS, **(MAMBA_V1_STANDINS if hasattr(module, "mamba_selective_scan") else {})}
            for name, standin in standins.items():
                if hasattr(module, name):
                    # By name, when the step runs: the tests wrap the stand-ins to count their calls.
                    stack.enter_context(mock.patch.object(module, name, globals()[standin]))
        yield

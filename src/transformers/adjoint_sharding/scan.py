"""Mamba's selective scan with an adjoint backward, one shard of tokens at a time (the adjoint sharding paper, §4.1-4.3).

For each channel d and state n the scan is a diagonal linear recurrence over time t:

    delta[t] = softplus(dt[t] + delta_bias)           (per batch, channel)
    a[t] = exp(delta[t] * A)      b[t] = delta[t] * u[t] * B[t]
    h[t] = a[t] * h[t-1] + b[t]   y[t] = sum_n C[t] * h[t]

Upstream's torch path stores a, b and every h for backward: three [batch, d, S, n] fp32 tensors
per layer. Here the forward runs shard by shard and keeps only its inputs (u, dt, B, C: [batch, d
or n, S]) and the state entering each shard. Backward goes over the shards from last to first:
it recomputes the shard's states from its boundary state, runs the adjoint recurrence

    adj[t] = C[t] * gy[t] + a[t+1] * adj[t+1]         (the adjoint sharding paper, Prop. 3.1 / 4.1: lambda)

carrying a[s0] * adj[s0] to the shard on the left, and takes every input's gradient as closed-form
vector-Jacobian products of that shard (da = adj * h[t-1], db = adj, dC = gy * h). Only one
shard's [shard, batch, d, n] tensors are alive at a time.

Truncated adjoint sharding (the adjoint sharding paper, §4.3, `truncation=T`): the gradient of y[t] reaches back only
through the transitions t-T+1..t (as if h[t-T] were a constant). The truncated adjoint is a window
sum, adjT[i] = sum_{t=i}^{i+T-1} C[t] gy[t] prod_{j=i+1}^{t} a[j], which obeys the same recurrence
with one term leaving the window per step:

    adjT[i] = C[i] gy[i] + a[i+1] adjT[i+1] - (prod_{j=i+1}^{i+T} a[j]) C[i+T] gy[i+T]

so it costs the exact backward plus one elementwise term; the window product is exp(A * (sum of
delta over the window)), with the running sum of delta taken once in fp64.
"""

import math

import torch
import torch.nn.functional as F

from ..mst_core.wrappers import refuse_create_graph


def linear_scan(a: torch.Tensor, b: torch.Tensor, initial: torch.Tensor | None = None) -> torch.Tensor:
    """States of h[t] = a[t] * h[t-1] + b[t] along dim 0, with h[-1] = `initial` (or 0).

    Block-parallel, so there is no Python step per token: the L steps are cut into about sqrt(L)
    blocks that all advance together from a zero state, one position per step; then each block
    adds its incoming state times the running product of its a's (a cumprod: no division, so
    no overflow when the products underflow). About 2 sqrt(L) tensor operations instead of L.
    """
    length = a.shape[0]
    block = max(1, math.isqrt(length))
    num_blocks = -(-length // block)
    pad = num_blocks * block - length
    if pad:  # a = 1, b = 0 carry the last state through the padding
        a = torch.cat([a, a.new_ones((pad, *a.shape[1:]))])
        b = torch.cat([b, b.new_zeros((pad, *b.shape[1:]))])
    a = a.reshape(num_blocks, block, *a.shape[1:])  # [L', ...] -> [num_blocks, block, ...], L' = num_blocks * block
    b = b.reshape(num_blocks, block, *b.shape[1:])
    states = torch.empty_like(b)
    h = torch.zeros_like(b[:, 0])
    for t in range(block):
        h = torch.addcmul(b[:, t], a[:, t], h)
        states[:, t] = h
    carry = initial
    for k in range(num_blocks):
        if carry is not None:
            states[k].addcmul_(torch.cumprod(a[k], dim=0), carry)
        carry = states[k, -1]
    return states.reshape(num_blocks * block, *states.shape[2:])[:length]  # back to [L, ...], padding dropped


def _delta(dt: torch.Tensor, delta_bias: torch.Tensor | None, softplus: bool) -> torch.Tensor:
    """Step sizes in fp32, [batch, d, L] -> [L, batch, d]; also returns the pre-softplus values."""
    pre = dt.float() if delta_bias is None else dt.float() + delta_bias.float()[:, None]
    pre = pre.permute(2, 0, 1).contiguous()  # time-major: each step of the scan reads one contiguous slice
    return (F.softplus(pre) if softplus else pre), pre


def _discretize(u, dt, A, B, delta_bias, softplus):
    """One shard's delta [L, b, d], a and b-terms [L, b, d, n], and the pre-softplus dt (for dt's grad)."""
    delta, pre = _delta(dt, delta_bias, softplus)
    u_t = u.float().permute(2, 0, 1).contiguous()  # [L, b, d]
    B_t = B.float().permute(2, 0, 1).contiguous()  # [L, b, n]
    a = torch.exp(delta[..., None] * A)
    b_terms = (delta * u_t)[..., None] * B_t[:, :, None, :]
    return delta, pre, u_t, B_t, a, b_terms


def _shards(seq_len: int, shard: int):
    return [(start, min(start + shard, seq_len)) for start in range(0, seq_len, shard)]


class AdjointSelectiveScan(torch.autograd.Function):
    """y = scan(u, dt, A, B, C) (before the D skip and the gate) and the last state; see the module doc."""

    @staticmethod
    def forward(ctx, u, dt, A, B, C, delta_bias, initial_state, shard, truncation, softplus, link=None):
        batch, channels, seq_len = u.shape
        y = torch.empty(batch, channels, seq_len, dtype=torch.float32, device=u.device)
        A = A.float()
        state = None if initial_state is None else initial_state.float()
        zero = u.new_zeros((batch, channels, A.shape[-1]), dtype=torch.float32)
        if link is not None and not link.first:  # a sequence split across processes (sequence.py)
            state = link.receive(zero, -1)
        boundaries = []  # the state entering each shard (None = zero)
        for start, end in _shards(seq_len, shard):
            boundaries.append(state)
            *_, a, b_terms = _discretize(
                u[:, :, start:end], dt[:, :, start:end], A, B[:, :, start:end], delta_bias, softplus
            )
            states = linear_scan(a, b_terms, state)
            del a, b_terms
            C_t = C[:, :, start:end].float().permute(2, 0, 1)  # [L, b, n]
            y[:, :, start:end] = torch.einsum("lbdn,lbn->bdl", states, C_t)
            state = states[-1].clone()  # the shard's other states are freed
            del states
        if link is not None and not link.last:
            link.send(state, +1)
        ctx.save_for_backward(
            u, dt, A, B, C, delta_bias, torch.stack([zero if s is None else s for s in boundaries])
        )
        ctx.shard, ctx.truncation, ctx.softplus, ctx.link = shard, truncation, softplus, link
        ctx.has_initial_state = initial_state is not None
        ctx.initial_dtype = None if initial_state is None else initial_state.dtype
        return y.to(u.dtype), state

    @staticmethod
    def backward(ctx, grad_y, grad_last_state):
        refuse_create_graph("adjoint sharding", "adjoint_sharding_chunk")
        u, dt, A, B, C, delta_bias, boundaries = ctx.saved_tensors
        shard, truncation, softplus = ctx.shard, ctx.truncation, ctx.softplus
        seq_len = u.shape[-1]
        grad_u = torch.empty(u.shape, dtype=torch.float32, device=u.device)
        grad_dt = torch.empty(dt.shape, dtype=torch.float32, device=u.device)
        grad_B = torch.empty(B.shape, dtype=torch.float32, device=u.device)
        grad_C = torch.empty(C.shape, dtype=torch.float32, device=u.device)
        grad_A = torch.zeros_like(A)
        grad_bias = None if delta_bias is None else torch.zeros(delta_bias.shape, dtype=torch.float32, device=u.device)
        # carry = a[end] * adj[end]: the adjoint entering this shard from the right (the last
        # state's own gradient for the last shard).
        carry = None if grad_last_state is None else grad_last_state.float()
        if ctx.link is not None and not ctx.link.last:  # the adjoint entering from the next rank's part
            carry = ctx.link.receive(boundaries[0], +1) + (0 if carry is None else carry)
        grad_y = torch.zeros(u.shape, dtype=torch.float32, device=u.device) if grad_y is None else grad_y.float()
        if truncation is not None and truncation < seq_len:
            delta_all, _ = _delta(dt, delta_bias, softplus)  # [S, b, d]
            delta_sum = F.pad(torch.cumsum(delta_all.double(), dim=0), (0, 0, 0, 0, 1, 0))  # [S + 1, b, d]
            del delta_all
        for index, (start, end) in reversed(list(enumerate(_shards(seq_len, shard)))):
            delta, pre, u_t, B_t, a, b_terms = _discretize(
                u[:, :, start:end], dt[:, :, start:end], A, B[:, :, start:end], delta_bias, softplus
            )
            initial = boundaries[index]
            states = linear_scan(a, b_terms, initial)
            del b_terms
            gy_t = grad_y[:, :, start:end].permute(2, 0, 1).contiguous()  # [L, b, d]
            C_t = C[:, :, start:end].float().permute(2, 0, 1).contiguous()  # [L, b, n]
            grad_C[:, :, start:end] = torch.einsum("lbdn,lbd->bnl", states, gy_t)
            source = gy_t[..., None] * C_t[:, :, None, :]  # C[t] gy[t]
            if truncation is not None and start + truncation < seq_len:
                _leave_window(source, start, end, truncation, seq_len, A, delta_sum, grad_y, C)
            if carry is not None:
                source[-1] += carry
            # adj[t] = source[t] + a[t+1] adj[t+1]: the forward scan on reversed time.
            a_next = torch.cat([a[1:], a.new_ones((1, *a.shape[1:]))])
            adjoint = linear_scan(a_next.flip(0), source.flip(0)).flip(0)
            del a_next, source
            carry = a[0] * adjoint[0]
            previous = torch.cat([initial[None], states[:-1]])  # h[t-1]
            del states
            grad_a_times_a = adjoint * previous * a  # d/d(delta * A) of exp(delta * A)
            del previous, a
            grad_delta = (grad_a_times_a * A).sum(-1)
            grad_A += torch.einsum("lbdn,lbd->dn", grad_a_times_a, delta)
            del grad_a_times_a
            adjoint_B = torch.einsum("lbdn,lbn->lbd", adjoint, B_t)  # sum_n adj * B
            grad_delta += u_t * adjoint_B
            grad_u[:, :, start:end] = (delta * adjoint_B).permute(1, 2, 0)  # [l, b, d] -> [b, d, l]
            grad_B[:, :, start:end] = torch.einsum("lbdn,lbd->bnl", adjoint, delta * u_t)
            del adjoint
            if softplus:
                grad_delta = grad_delta * torch.sigmoid(pre)
            grad_dt[:, :, start:end] = grad_delta.permute(1, 2, 0)  # [l, b, d] -> [b, d, l]
            if grad_bias is not None:
                grad_bias += grad_delta.sum((0, 1))
        if ctx.link is not None and not ctx.link.first:
            ctx.link.send(carry, -1)
        grad_initial = carry.to(ctx.initial_dtype) if ctx.has_initial_state else None
        return (
            grad_u.to(u.dtype),
            grad_dt.to(dt.dtype),
            grad_A,
            grad_B.to(B.dtype),
            grad_C.to(C.dtype),
            None if grad_bias is None else grad_bias.to(delta_bias.dtype),
            grad_initial,
            None,
            None,
            None,
            None,
        )


def _leave_window(source, start, end, truncation, seq_len, A, delta_sum, grad_y, C):
    """Subtract, for rows i of this shard with i + T < S, the term of output i + T, which leaves the
    truncation window at i: prod_{j=i+1}^{i+T} a[j] * C[i+T] gy[i+T] (see the module doc)."""
    stop = min(end, seq_len - truncation)
    ahead = slice(start + truncation, stop + truncation)
    window_delta = (delta_sum[start + truncation + 1 : stop + truncation + 1] - delta_sum[start + 1 : stop + 1]).float()
    window_product = torch.exp(window_delta[..., None] * A)  # [rows, b, d, n]
    gy_ahead = grad_y[:, :, ahead].permute(2, 0, 1)  # [b, d, rows] -> [rows, b, d]
    C_ahead = C[:, :, ahead].float().permute(2, 0, 1)  # [b, n, rows] -> [rows, b, n]
    source[: stop - start] -= window_product * gy_ahead[..., None] * C_ahead[:, :, None, :]


def selective_scan(
    hidden_states,
    dt,
    A,
    B,
    C,
    D=None,
    z=None,
    delta_bias=None,
    delta_softplus=False,
    return_last_state=False,
    *,
    shard: int,
    truncation: int | None = None,
    initial_state=None,
    link=None,
    **kwargs,
):
    """Drop-in for upstream's `mamba_selective_scan` (same arguments and dtypes; `use_mambapy` and
    `use_associative_scan` are ignored: this is the scan) with the adjoint backward above."""
    scan_output, last_state = AdjointSelectiveScan.apply(
        hidden_states, dt, A, B, C, delta_bias, initial_state, shard, truncation, delta_softplus, link
    )
    if D is not None:
        scan_output = scan_output + hidden_states * D[None, :, None]
    if z is not None:
        scan_output = scan_output * F.silu(z)
    if return_last_state:
        return scan_output, last_state
    return scan_output

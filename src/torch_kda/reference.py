"""Pure-PyTorch Kimi Delta Attention: the readable definition every fast path is tested against.

Read beside the repository's ``docs/math.md`` (sections "Forward recurrence", "Gates",
"Saturation" and "Chunkwise form"); the math comes from the Kimi Linear technical report
(arXiv 2510.26692, Eq. 1 and Eq. 10) and the public contract of flash-linear-attention's
``fla.ops.kda``. Everything here is ordinary autograd-traced PyTorch, so gradients of any order
work on any device; nothing here is fast.

Shapes: ``q, k [B, T, H, K]``, ``v [B, T, HV, V]``, ``g [B, T, HV, K]``, ``beta [B, T, HV]``,
state ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``). Arithmetic is float32, or
float64 for float64 ``q``; ``o`` comes back in ``q``'s dtype, the final state in the compute dtype.
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from ._checks import KDAInputs, ServingArgs, check_gate_args, check_kda_inputs, check_value_domain
from ._pool import gather_states, scatter_states, sequences

__all__ = ["fused_recurrent_kda", "chunk_kda", "kda_gate", "l2norm"]

L2NORM_EPS = 1e-6
SOFTPLUS_THRESHOLD = 20.0
# exp(A_log) from which the softplus gate is formed in log space (_gate; the native kernels'
# kLogSpaceRate, csrc/cpu/kernels/recurrent_kernels.h).
LOG_SPACE_RATE = 2.0 ** 64
FULL_FORGET = 100.0  # chunkwise form: per-step log-decays are clamped at -FULL_FORGET (see _chunk_scan)


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``x / sqrt(sum(x**2, -1) + eps)`` along the last axis (docs/math.md "Forward recurrence", first line)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def sigmoid_accurate_slope(x: torch.Tensor) -> torch.Tensor:
    """``sigmoid(x)``, elementwise, written as ``exp(logsigmoid(x))`` for its gradient.

    Autograd forms this function's slope as ``sigmoid(x) * sigmoid(-x)``, which keeps its relative
    precision where ``sigmoid(x)`` rounds to 1 (x > ~17 in float32; from x ~ 12 only a few bits of
    ``1 - sigmoid(x)`` are left), while ``torch.sigmoid``'s ``s * (1 - s)`` is 0 or coarse there
    (docs/math.md "Saturation"). The value equals ``torch.sigmoid(x)`` to rounding, except below
    x ~ -88.7 in float32, where it keeps the subnormal e^x that ``torch.sigmoid`` (and the native
    op) flush to 0.

    Args: ``x``: any shape, a floating dtype. Returns: the same shape and dtype.
    Raises: nothing of its own (torch's errors for a non-floating ``x``).
    """
    return torch.exp(F.logsigmoid(x))


def _gate(g: torch.Tensor, A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor],
          lower_bound: Optional[float]) -> torch.Tensor:
    """Log-decay from the raw gate input ``g [..., HV, K]``; inputs already checked."""
    dtype = torch.float64 if g.dtype == torch.float64 else torch.float32
    HV, K = g.shape[-2], g.shape[-1]
    z = g.to(dtype)
    if dt_bias is not None:
        z = z + dt_bias.to(dtype).reshape(HV, K)
    saturated = None
    if A_log is not None:
        # Saturation (docs/math.md "Saturation"): where exp(A_log) overflows, the softplus gate is
        # the log-space form below, the bounded gate its step with zero gradient. A_log is
        # replaced by 0 there BEFORE exp, so no inf enters the autograd graph (autograd would
        # otherwise form 0 * inf = NaN in the backward of exp and of the products).
        A = A_log.to(dtype).reshape(HV, 1)
        # exp itself decides: A > math.log(max) missed A = float32(log(max)) = 88.7228394,
        # whose float32 exp is inf (the bound rounds to A when compared in float32).
        exp_A = A.detach().exp()
        saturated = torch.isinf(exp_A)
        rate = torch.where(saturated, torch.zeros_like(A), A).exp()
    if lower_bound is None:
        # softplus gate: g = -exp(A_log) * softplus(z) (saturated: replaced by the log-space form).
        # Where the product itself is -inf (z = +inf, or a large rate times a large softplus) the
        # decay is 0 and so is every gradient through the gate, its limit: the product is formed
        # again from 0 there, so that autograd does not form 0 * inf = NaN for A_log. z = +inf
        # takes that limit under any rate, also one whose exp underflowed to 0 (A_log < -103.9
        # in float32), where rate * inf is NaN. A NaN z stays NaN, saturated or not (NaN
        # propagates by policy, docs/bad_inputs.md).
        sp = F.softplus(z, beta=1.0, threshold=SOFTPLUS_THRESHOLD)
        spd = sp.detach()
        # (a saturated head's rate is exp(0) here: its product is discarded for the log-space form)
        to_zero = (torch.isinf((rate * spd).detach()) | torch.isinf(spd)) & ~spd.isnan()
        g_log = -rate * torch.where(to_zero, torch.zeros_like(sp), sp)
        g_log = torch.where(to_zero, torch.full_like(g_log, -math.inf), g_log)
        # Rates from 2^64 on (A_log > 44.4; saturated ones too) take the product in log space,
        # -exp(A_log + log softplus(z)), as the native kernels do (LOG_SPACE_RATE): with
        # such a rate a softplus(z) below float32's range (z < -87.3) is not negligible, and an
        # overflowed rate keeps the decay near 1 of a z far below 0. Below z = -20, log
        # softplus(z) = z + log1p(y (y / 3 - 1 / 2)), y = e^z; -inf (decay 0) where the exponent
        # overflows (A_log = +inf too, for every z that is a number), formed again from 0 for
        # autograd.
        log_space = exp_A >= LOG_SPACE_RATE
        below = z < -20
        y = torch.where(below, z, torch.zeros_like(z)).exp()
        log_sp = torch.where(below, z + torch.log1p(y * (y / 3 - 0.5)),
                             torch.log(torch.where(below, torch.ones_like(sp), sp)))
        x = A + log_sp
        big = torch.isinf(x.detach().exp()) | ((A.detach() == math.inf) & ~z.detach().isnan())
        g_ls = -torch.where(big, torch.zeros_like(x), x).exp()
        g_ls = torch.where(big, torch.full_like(g_ls, -math.inf), g_ls)
        return torch.where(log_space, g_ls, g_log)
    # bounded gate: g = lower_bound * sigmoid(exp(A_log) * z), in [lower_bound, 0);
    # saturated: sigmoid(inf * z) = (sign(z) + 1) / 2
    if A_log is None:
        return lower_bound * sigmoid_accurate_slope(z)
    # Where exp(A_log) * z is infinite (z itself infinite, or a large rate times a large z) the
    # gate is that step too, its gradient 0 (the limit of sigmoid'(x) z); z is replaced by 0 there
    # so that autograd does not form 0 * inf = NaN for A_log. (Saturated, rate is 1 and x = z.)
    # An infinite z takes the step under any rate, also one whose exp underflowed to 0, where
    # rate * z is NaN; the step's side is sign(z), which is sign(x) for every rate > 0. A NaN z
    # stays NaN.
    zd = z.detach()
    step = (torch.isinf(rate.detach() * zd) | torch.isinf(zd) | saturated) & ~zd.isnan()
    s = sigmoid_accurate_slope(rate * torch.where(step, torch.zeros_like(z), z))
    return lower_bound * torch.where(step, (torch.sign(zd) + 1) / 2, s)


def kda_gate(g: torch.Tensor, A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor] = None,
             lower_bound: Optional[float] = None) -> torch.Tensor:
    """KDA's per-channel log-decay computed from the raw gate input.

    Args:
        g: raw gate input ``[..., HV, K]``, any float dtype.
        A_log: ``[HV]`` log of the decay rate (may be None only with ``lower_bound``).
        dt_bias: ``[HV * K]`` or ``[HV, K]`` bias added to ``g`` first, or None.
        lower_bound: None for the softplus gate ``-exp(A_log) * softplus(g + dt_bias)``;
            a negative float for the bounded gate ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``.

    Returns:
        the log-decay, same shape as ``g``, float32 (float64 for float64 ``g``), ``<= 0``.

    Raises:
        TypeError / ValueError: wrong types, shapes, missing ``A_log`` for the softplus gate,
        ``lower_bound >= 0``.

    Source: Kimi Linear report (arXiv 2510.26692) and FLA's ``fla.ops.kda.gate``; docs/math.md
    "Gates" and "Saturation".
    """
    check_gate_args(g, A_log, dt_bias, lower_bound)
    return _gate(g, A_log, dt_bias, lower_bound)


def _prepare(x: KDAInputs) -> Tuple[torch.Tensor, ...]:
    """Gate, beta, l2-norm and GVA expansion: returns compute-dtype q̃, k̂, v, g, beta with HV heads."""
    dtype = x.compute_dtype
    group = x.HV // x.H
    q, k = x.q.to(dtype), x.k.to(dtype)
    if x.use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q = q * x.scale
    if group > 1:  # value head hv reads query/key head hv // group
        q = q.repeat_interleave(group, dim=2)
        k = k.repeat_interleave(group, dim=2)
    if x.use_gate_in_kernel:
        g = _gate(x.g.to(dtype), x.A_log, x.dt_bias, x.lower_bound)  # g may be wider (fp64)
    else:
        g = x.g.to(dtype)
    beta = x.beta.to(dtype)
    if x.use_beta_sigmoid_in_kernel:
        beta = sigmoid_accurate_slope(beta) * (2.0 if x.allow_neg_eigval else 1.0)
    return q, k, x.v.to(dtype), g, beta


def _initial_state(x: KDAInputs) -> torch.Tensor:
    """``[N, HV, K, V]`` in the compute dtype (zeros when no initial state is given)."""
    if x.initial_state is None:
        return x.q.new_zeros(x.N, x.HV, x.K, x.V, dtype=x.compute_dtype)
    s = x.initial_state.to(x.compute_dtype)
    return s.transpose(-1, -2) if x.state_v_first else s


def _recurrent_scan(q, k, v, g, beta, S):
    """Token-by-token recurrence (docs/math.md "Forward recurrence") on ``[n, t, HV, *]`` tensors."""
    outputs = []
    for t in range(q.shape[1]):
        S = S * g[:, t].exp().unsqueeze(-1)                           # S' = Diag(a_t) S
        r = v[:, t] - torch.einsum("nhk,nhkv->nhv", k[:, t], S)        # delta-rule error
        b = beta[:, t]                                                 # [n, HV] or head-wise [n, HV, V]
        u = (b if b.dim() == r.dim() else b.unsqueeze(-1)) * r
        S = S + k[:, t].unsqueeze(-1) * u.unsqueeze(-2)               # rank-1 write
        outputs.append(torch.einsum("nhk,nhkv->nhv", q[:, t], S))      # read after the write
    o = torch.stack(outputs, dim=1) if outputs else v.new_zeros(v.shape)
    return o, S


def _decay_matrix(G_rows: torch.Tensor, G_cols: torch.Tensor, diagonal: int) -> torch.Tensor:
    """``exp(G_rows[i] - G_cols[j])`` where ``j <= i + diagonal`` (``[n, h, c, c, K]``), 0 elsewhere.

    The exponent is formed and masked BEFORE exponentiation, so no positive exponent is ever
    exponentiated (no overflow however strong the decay) and, because masked entries carry no
    gradient, a later token's gate cannot reach an earlier output (causality).
    """
    c = G_rows.shape[2]
    keep = torch.ones(c, c, dtype=torch.bool, device=G_rows.device).tril(diagonal)
    diff = G_rows.unsqueeze(3) - G_cols.unsqueeze(2)                   # [n, h, c(i), c(j), K]
    return diff.masked_fill(~keep[:, :, None], float("-inf")).exp()


def _chunk_scan(q, k, v, g, beta, S, chunk_size: int):
    """Chunkwise form (docs/math.md "Chunkwise form", WY/UT transform) on ``[n, t, HV, *]`` tensors."""
    n, T = q.shape[:2]
    if T == 0:
        return v.new_zeros(v.shape), S
    pad = (-T) % chunk_size
    if pad:
        # Padding tokens with k = 0, beta = 0 and g = 0 write nothing and decay nothing: exact.
        q, k, v, g = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, 0, 0, pad))
    # [n, T, h, d] -> [n, h, chunks, C, d]
    # A per-step log-decay below -FULL_FORGET is a full forget in floating point (exp(-100) is
    # 4e-44); clamping it keeps the in-chunk differences G_i - G_j finite (an infinite decay would
    # give -inf - -inf = NaN) and bounds the cancellation in them. No effect on gradients: d/dg of
    # exp(g) is itself below 4e-44 there.
    g = g.clamp(min=-FULL_FORGET)
    q, k, v, g = (x.unflatten(1, (-1, chunk_size)).permute(0, 3, 1, 2, 4) for x in (q, k, v, g))
    beta = beta.unflatten(1, (-1, chunk_size)).permute(0, 3, 1, 2)
    dtype = q.dtype
    # The in-chunk cumulative log-decay G and its differences G_i - G_j are formed in float64:
    # after strong decays G reaches thousands (64 steps of -100), where the float32 spacing
    # (~5e-4) would swallow the small decays that follow (docs/math.md "Chunkwise form").
    # Only the exponentials are rounded back to the compute dtype. (MPS has no float64.)
    wide = torch.float64 if q.device.type != "mps" else dtype
    exp_ = lambda x: x.exp().to(dtype)
    eye = torch.eye(chunk_size, dtype=dtype, device=q.device)
    outputs = []
    for c in range(q.shape[2]):
        qc, kc, vc, bc = q[:, :, c], k[:, :, c], v[:, :, c], beta[:, :, c].unsqueeze(-1)
        G = g[:, :, c].to(wide).cumsum(dim=2)                          # [n, h, C, K], <= 0
        strict = _decay_matrix(G, G, -1).to(dtype)                     # exp(G_i - G_j), j < i
        causal = _decay_matrix(G, G, 0).to(dtype)                      # exp(G_i - G_j), j <= i
        Akk = bc * torch.einsum("nhik,nhjk,nhijk->nhij", kc, kc, strict)
        Aqk = torch.einsum("nhik,nhjk,nhijk->nhij", qc, kc, causal)
        # (I + Akk)^-1 by forward substitution on the unit lower-triangular system
        T_inv = lambda rhs: torch.linalg.solve_triangular(eye + Akk, rhs, upper=False, unitriangular=True)
        W = T_inv(bc * kc * exp_(G))
        U = T_inv(bc * vc)
        V_new = U - W @ S
        outputs.append((qc * exp_(G)) @ S + Aqk @ V_new)
        G_last = G[:, :, -1:]                                          # [n, h, 1, K]
        S = S * exp_(G_last.transpose(-1, -2)) + (exp_(G_last - G) * kc).transpose(-1, -2) @ V_new
    o = torch.stack(outputs, dim=2).permute(0, 2, 3, 1, 4).flatten(1, 2)  # [n, T+pad, h, V]
    return o[:, :T], S


def _run(x: KDAInputs, scan) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    check_value_domain(x)  # g <= 0, beta in [0, 2], beta ||k||^2 <= 2 (docs/bad_inputs.md)
    q, k, v, g, beta = _prepare(x)
    S0 = _initial_state(x)
    if x.cu_seqlens is None:
        o, S = scan(q, k, v, g, beta, S0)
    else:
        outs, states = [], []
        for i, (start, end) in enumerate(zip(x.seq_bounds[:-1], x.seq_bounds[1:])):
            o_i, S_i = scan(*(t[:, start:end] for t in (q, k, v, g, beta)), S0[i:i + 1])
            outs.append(o_i)
            states.append(S_i)
        o = torch.cat(outs, dim=1) if outs else v.new_zeros(v.shape)
        S = torch.cat(states, dim=0) if states else S0
    if x.T == 0:
        o, S = _tie_to_tokens(o, (q, k, v, g, beta)), _tie_to_tokens(S, (q, k, v, g, beta))
    if not x.output_final_state:
        return o.to(x.q.dtype), None
    return o.to(x.q.dtype), (S.transpose(-1, -2) if x.state_v_first else S).contiguous()


def _tie_to_tokens(t: torch.Tensor, token_inputs) -> torch.Tensor:
    """Without tokens (T = 0) nothing is computed, but the outputs must stay in the autograd
    graph of the inputs, as the native op's do (zero gradients), so that ``loss.backward()``
    behaves the same on every backend: ``t`` plus 0 times the (empty, so exactly 0) sums of the
    per-token inputs that require grad; ``t`` itself when it already does or none does."""
    tied = [x.sum() for x in token_inputs if x.requires_grad]
    if t.requires_grad or not tied:
        return t
    return t + 0 * torch.stack(tied).sum().to(t.dtype)


def _scan_for(method: str, chunk_size: int):
    if method == "recurrent":
        return _recurrent_scan
    return lambda *args: _chunk_scan(*args, chunk_size=chunk_size)


def fused_recurrent_kda(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False, use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False, lower_bound: Optional[float] = None,
    state_v_first: bool = False, cu_seqlens: Optional[torch.Tensor] = None,
    A_log: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """KDA by its token-by-token recurrence, in plain PyTorch (the definition).

    Same arguments, shapes, dtypes and errors as :func:`torch_kda.fused_recurrent_kda`; see its
    docstring. Differentiable to any order. Source: docs/math.md "Forward recurrence"
    (Kimi Linear report, arXiv 2510.26692, Eq. 1).
    """
    x = check_kda_inputs(q, k, v, g, beta, scale, initial_state, output_final_state,
                         use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                         allow_neg_eigval, False, lower_bound, state_v_first, cu_seqlens, A_log, dt_bias)
    return run_reference(x, "recurrent")


def chunk_kda(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False, use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False, safe_gate: bool = False, lower_bound: Optional[float] = None,
    state_v_first: bool = False, cu_seqlens: Optional[torch.Tensor] = None,
    A_log: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None,
    chunk_size: int = 64,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """KDA by its chunkwise (WY/UT transform) form, in plain PyTorch.

    Same arguments, shapes, dtypes and errors as :func:`torch_kda.chunk_kda`; any ``T`` (the last
    chunk is padded exactly), finite under the strongest decays (exponents are formed as
    differences ``G_i - G_j <= 0`` before ``exp``; per-step log-decays below ``-FULL_FORGET`` =
    -100, a full forget, are clamped there), causal. One difference from the recurrence: a NaN or
    Inf input can also reach EARLIER outputs of its own chunk (the chunk's matrix products
    multiply masked zeros by it); other sequences are never affected. Differentiable to any
    order. Source:
    docs/math.md "Chunkwise form" (Kimi Linear report, arXiv 2510.26692, Eq. 10).
    """
    x = check_kda_inputs(q, k, v, g, beta, scale, initial_state, output_final_state,
                         use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                         allow_neg_eigval, safe_gate, lower_bound, state_v_first, cu_seqlens, A_log,
                         dt_bias, chunk_size)
    return run_reference(x, "chunk")


def _without_autocast(run):
    """``run(x, ...)`` with autocast off on ``x``'s device: the reference computes in fp32 (fp64
    for fp64 inputs) as the other backends do, whatever autocast would pick for its einsums and
    products (bf16 under ``torch.autocast("cpu")``: 3e-3 relative error instead of 2e-7)."""
    @functools.wraps(run)
    def wrapped(x: KDAInputs, *args, **kwargs):
        device = x.q.device.type
        if not torch.is_autocast_enabled(device):
            return run(x, *args, **kwargs)
        with torch.autocast(device, enabled=False):
            return run(x, *args, **kwargs)
    return wrapped


@_without_autocast
def run_reference(x: KDAInputs, method: str) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Run checked inputs through the recurrent or chunkwise reference (used by the dispatcher)."""
    return _run(x, _scan_for(method, x.chunk_size))


# ---- serving: a state pool addressed by slot indices (docs/serving.md) ------------------------


@_without_autocast
def run_serving_reference(x: KDAInputs, s: ServingArgs, method: str = "recurrent"):
    """The serving contract in plain PyTorch: gather each sequence's state, run it, scatter back.

    For sequence ``n``: start from pool slot ``s.read_slots[n]`` (or ``initial_state[n]`` / zeros
    without indices), run its tokens through the recurrence (``method="recurrent"``) or the chunkwise
    form (``"chunk"``), write the state after token ``t`` to ``s.snapshot_slots[n][t]`` (2-D indices)
    and the final state to ``s.final_slots[n]`` (in-place calls). Pad sequences output zeros and
    write nothing. Arguments are checked by ``_checks.check_serving_inputs``.

    Returns ``(o, final_state)``, plus the chunk-entry states with ``return_intermediate_states``:
    ``o`` is ``s.out`` when given; ``final_state`` is the pool itself for in-place calls, else a fresh
    ``[N, HV, K, V]`` state (or None without ``output_final_state``).
    """
    check_value_domain(x)  # before anything is written to the pool (docs/bad_inputs.md)
    q, k, v, g, beta = _prepare(x)
    pool = x.initial_state
    layout = (lambda S: S.transpose(-1, -2)) if x.state_v_first else (lambda S: S)  # K-first <-> pool
    starts = gather_states(x, s)  # [N, ...] compute dtype, pool layout; zeros for pad sequences

    o = v.new_zeros(v.shape)
    finals, inter = [], []
    for n, (b, start, end) in enumerate(sequences(x)):
        if s.is_pad[n]:  # pad slot: zero output, nothing read or written
            finals.append(v.new_zeros(1, x.HV, x.K, x.V))
            if method == "chunk" and s.return_intermediate_states:
                inter.extend(v.new_zeros(-(-(end - start) // x.chunk_size), x.HV, x.K, x.V))
            continue
        S = layout(starts[n:n + 1]) if starts is not None else v.new_zeros(1, x.HV, x.K, x.V)
        seq = [t[b:b + 1, start:end] for t in (q, k, v, g, beta)]
        outs = []
        if method == "chunk":  # chunk by chunk, keeping the state entering each chunk
            for c0 in range(0, end - start, x.chunk_size):
                inter.append(S[0])
                o_c, S = _chunk_scan(*(t[:, c0:c0 + x.chunk_size] for t in seq), S, x.chunk_size)
                outs.append(o_c)
        else:  # token by token, writing the snapshot of every token that names a slot
            for t in range(end - start):
                o_t, S = _recurrent_scan(*(u[:, t:t + 1] for u in seq), S)
                outs.append(o_t)
                if s.snapshot_slots is not None and s.snapshot_slots[n][t] is not None:
                    scatter_states(pool, [s.snapshot_slots[n][t]], layout(S))
        if outs:
            o[b:b + 1, start:end] = torch.cat(outs, dim=1)
        finals.append(S)
    if s.final_slots is not None and finals:  # in-place calls (the checks made this inference only)
        scatter_states(pool, s.final_slots, layout(torch.cat(finals, dim=0)))

    o = o.to(x.q.dtype)
    if s.out is not None:
        with torch.no_grad():
            s.out.copy_(o)
        o = s.out
    if s.inplace_final_state:
        final = pool
    elif x.output_final_state:
        S = torch.cat(finals, dim=0) if finals else v.new_zeros(0, x.HV, x.K, x.V)
        final = (S.transpose(-1, -2) if x.state_v_first else S).contiguous()
    else:
        final = None
    if method == "chunk" and s.return_intermediate_states:
        h = torch.stack(inter) if inter else v.new_zeros(0, x.HV, x.K, x.V)
        h = (h.transpose(-1, -2) if x.state_v_first else h).contiguous()
        # FLA's shape: [B, NT, ...] for equal lengths, [1, NT_total, ...] with cu_seqlens
        h = h.reshape(x.B if x.cu_seqlens is None else 1, -1, *h.shape[1:])
        return o, final, h
    return o, final

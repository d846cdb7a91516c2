"""An independent float64 oracle: KDA written as plain per-sequence, per-head, per-token loops.

It shares no code with ``torch_kda`` (its own gate, norm and recurrence), so a mistake in the
library's preprocessing or state handling cannot hide behind the same mistake here.
"""

from __future__ import annotations

import math

import torch


def _softplus(x: float) -> float:
    return x if x > 20.0 else math.log1p(math.exp(x))


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def oracle_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
               use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
               use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, safe_gate=False,
               lower_bound=None, state_v_first=False, cu_seqlens=None, A_log=None, dt_bias=None,
               chunk_size=None):
    """Float64 KDA forward; returns ``(o, final_state)`` like ``chunk_kda`` (state in fp64)."""
    q, k, v, g, beta = (t.detach().double() for t in (q, k, v, g, beta))
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    group = HV // H
    scale = K ** -0.5 if scale is None else scale
    if cu_seqlens is None:
        segments = [(b, 0, T) for b in range(B)]
    else:
        bounds = [int(c) for c in cu_seqlens.tolist()]
        segments = [(0, s, e) for s, e in zip(bounds[:-1], bounds[1:])]
    o = torch.zeros(B, T, HV, V, dtype=torch.float64)
    finals = torch.zeros(len(segments), HV, K, V, dtype=torch.float64)
    A = A_log.detach().double() if A_log is not None else None
    dt = dt_bias.detach().double().reshape(HV, K) if dt_bias is not None else None
    for n, (b, start, end) in enumerate(segments):
        for hv in range(HV):
            h = hv // group
            if initial_state is None:
                S = torch.zeros(K, V, dtype=torch.float64)
            else:
                S0 = initial_state[n, hv].detach().double()
                S = S0.t().clone() if state_v_first else S0.clone()
            for t in range(start, end):
                qt, kt = q[b, t, h].clone(), k[b, t, h].clone()
                if use_qk_l2norm_in_kernel:
                    qt = qt / math.sqrt(float((qt * qt).sum()) + 1e-6)
                    kt = kt / math.sqrt(float((kt * kt).sum()) + 1e-6)
                qt = qt * scale
                decay = torch.empty(K, dtype=torch.float64)
                for i in range(K):
                    x = float(g[b, t, hv, i])
                    if use_gate_in_kernel:
                        z = x + (float(dt[hv, i]) if dt is not None else 0.0)
                        if lower_bound is None:
                            x = -math.exp(float(A[hv])) * _softplus(z)
                        else:
                            rate = math.exp(float(A[hv])) if A is not None else 1.0
                            x = lower_bound * _sigmoid(rate * z)
                    decay[i] = math.exp(x)
                bt = float(beta[b, t, hv])
                if use_beta_sigmoid_in_kernel:
                    bt = _sigmoid(bt) * (2.0 if allow_neg_eigval else 1.0)
                S = decay[:, None] * S
                u = bt * (v[b, t, hv] - S.t() @ kt)
                S = S + torch.outer(kt, u)
                o[b, t, hv] = S.t() @ qt
            finals[n, hv] = S
    if state_v_first:
        finals = finals.transpose(-1, -2).contiguous()
    return o, (finals if output_final_state else None)

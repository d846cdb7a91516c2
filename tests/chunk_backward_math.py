"""The chunkwise backward of docs/math.md "Chunkwise backward", written out in float64 PyTorch.

A readable statement of what csrc/cpu/chunk_bwd.cpp computes, line by line, for one value head of
one sequence on the pre-processed inputs (q = scale * qhat, k = khat, log-decay g, write strength
beta). tests/test_chunk_backward.py checks it against torch.autograd of the chunk formulas and of
the recurrence, so the C++ kernel and this file stand on a verified derivation.

Shapes: q, k, g [T, K]; v [T, V]; beta [T]; states [K, V]. Chunks of C = 64 tokens; inside a
chunk the strictly-lower matrices are built from 16-token sub-blocks with the reference point r
(the last token before the row block), as the kernel does.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

CHUNK = 64
BLOCK = 16
FULL_FORGET = 100.0


def _pair_terms(Gi, Gj, lower: bool):
    """exp(G_i - G_j) for i in rows, j in columns, masked before exp ([I, J, K])."""
    diff = Gi[:, None, :] - Gj[None, :, :]
    I, J = Gi.shape[0], Gj.shape[0]
    keep = torch.ones(I, J, dtype=torch.bool).tril(-1 if lower else 0)
    return torch.where(keep[..., None], diff, torch.full_like(diff, -torch.inf)).exp()


def chunk_forward(q, k, v, g, beta, S):
    """Forward of one chunk (docs/math.md "Chunkwise form"); returns (O, S_next, saved dict)."""
    g = g.clamp(min=-FULL_FORGET)
    G = g.cumsum(0)
    Gam = G.exp()
    A0 = torch.einsum("id,jd,ijd->ij", k, k, _pair_terms(G, G, True))
    M = torch.einsum("id,jd,ijd->ij", q, k, _pair_terms(G, G, False))
    A = beta[:, None] * A0
    n = q.shape[0]
    Tinv = torch.linalg.solve_triangular(torch.eye(n, dtype=q.dtype) + A, torch.eye(n, dtype=q.dtype),
                                         upper=False, unitriangular=True)
    BV, BGK = beta[:, None] * v, beta[:, None] * Gam * k
    U, W = Tinv @ BV, Tinv @ BGK
    Vn = U - W @ S
    O = (q * Gam) @ S + M @ Vn
    Kdec = (G[-1:] - G).exp() * k
    S_next = Gam[-1][:, None] * S + Kdec.t() @ Vn
    saved = dict(G=G, Gam=Gam, A0=A0, M=M, Tinv=Tinv, BV=BV, BGK=BGK, U=U, W=W, Vn=Vn, Kdec=Kdec)
    return O, S_next, saved


def _through_pairs(dP, Xrow, Y, G, lower: bool, dX, dY, dG):
    """Gradients through P_ij = sum_d X_id Y_jd exp(G_id - G_jd) (masked to j < i or j <= i).

    Off-diagonal 16x16 blocks use the factored form with the reference point r = the last token
    before the row block: row factor X_i exp(G_i - G_r), column factor Y_j exp(G_r - G_j), both
    <= 1 in magnitude of the exponent; G_r cancels. Diagonal blocks use the direct form.
    Accumulates into dX (rows' input), dY (columns' input) and dG.
    """
    n = G.shape[0]
    for i0 in range(0, n, BLOCK):
        i1 = min(n, i0 + BLOCK)
        I = slice(i0, i1)
        if i0 > 0:
            r = i0 - 1
            er = (G[I] - G[r]).exp()                 # [I, K]
            ec = (G[r] - G[:i0]).exp()               # [J, K]
            Xl, Yr = Xrow[I] * er, Y[:i0] * ec
            d = dP[I, :i0]
            dXl, dYr = d @ Yr, d.t() @ Xl
            dX[I] += dXl * er
            dG[I] += dXl * Xl
            dY[:i0] += dYr * ec
            dG[:i0] -= dYr * Yr
        E = _pair_terms(G[I], G[I], lower)           # [I, I, K]
        d = dP[I, I]
        t = d[..., None] * E                          # [I, J, K]
        dX[I] += torch.einsum("ijd,jd->id", t, Y[I])
        dY[I] += torch.einsum("ijd,id->jd", t, Xrow[I])
        both = t * Xrow[I][:, None, :] * Y[I][None, :, :]
        dG[I] += both.sum(1)
        dG[I] -= both.sum(0)


def chunk_backward(q, k, v, g, beta, S, dO, dS_next):
    """Backward of one chunk: (dq, dk, dv, dg, dbeta, dS) from dO [C, V] and dS_next [K, V]."""
    _, _, s = chunk_forward(q, k, v, g, beta, S)
    G, Gam, Tinv, Vn, W, U = s["G"], s["Gam"], s["Tinv"], s["Vn"], s["W"], s["U"]
    Kdec, M, A0 = s["Kdec"], s["M"], s["A0"]
    dq, dk, dG = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(G)
    # O = (Q . Gam) S + M Vn ;  S_next = Diag(Gam_last) S + Kdec^T Vn
    dVn = M.t() @ dO + Kdec @ dS_next
    dM = (dO @ Vn.t()).tril()
    dQG = dO @ S.t()
    dKdec = Vn @ dS_next.t()
    # Vn = U - W S
    dW = -dVn @ S.t()
    dS = (q * Gam).t() @ dO + Gam[-1][:, None] * dS_next - W.t() @ dVn
    # U = Tinv BV, W = Tinv BGK, Tinv = (I + A)^-1
    dBV, dBGK = Tinv.t() @ dVn, Tinv.t() @ dW
    dA = -(dBV @ U.t() + dBGK @ W.t()).tril(-1)
    dbeta = (dA * A0).sum(1) + (dBV * v).sum(1) + (dBGK * Gam * k).sum(1)
    dA0 = beta[:, None] * dA
    dv = beta[:, None] * dBV
    dk += beta[:, None] * Gam * dBGK
    dG += beta[:, None] * Gam * k * dBGK
    dq += Gam * dQG
    dG += Gam * q * dQG
    dG[-1] += Gam[-1] * (S * dS_next).sum(1)
    dk += (G[-1:] - G).exp() * dKdec
    dG[-1] += (Kdec * dKdec).sum(0)
    dG -= Kdec * dKdec
    _through_pairs(dA0, k, k, G, True, dk, dk, dG)
    _through_pairs(dM, q, k, G, False, dq, dk, dG)
    # G = cumsum(clamp(g)): reverse cumsum; clamped steps get 0
    dg = dG.flip(0).cumsum(0).flip(0)
    dg = torch.where(g < -FULL_FORGET, torch.zeros_like(dg), dg)
    return dq, dk, dv, dg, dbeta, dS


def sequence_forward(q, k, v, g, beta, S0) -> Tuple[torch.Tensor, torch.Tensor, List[torch.Tensor]]:
    """Chunk by chunk over one sequence: (o [T, V], final state, states before each chunk)."""
    outs, ckpts, S = [], [], S0
    for c0 in range(0, q.shape[0], CHUNK):
        c = slice(c0, c0 + CHUNK)
        ckpts.append(S)
        O, S, _ = chunk_forward(q[c], k[c], v[c], g[c], beta[c], S)
        outs.append(O)
    o = torch.cat(outs) if outs else v.new_zeros(v.shape)
    return o, S, ckpts


def sequence_backward(q, k, v, g, beta, S0, do, dST) -> Dict[str, torch.Tensor]:
    """Chunks from last to first, each recomputed from its checkpoint; dS flows backwards."""
    _, _, ckpts = sequence_forward(q, k, v, g, beta, S0)
    grads = {n: torch.zeros_like(x) for n, x in dict(q=q, k=k, v=v, g=g, beta=beta).items()}
    dS = dST
    for ci in reversed(range(len(ckpts))):
        c = slice(ci * CHUNK, (ci + 1) * CHUNK)
        r = chunk_backward(q[c], k[c], v[c], g[c], beta[c], ckpts[ci], do[c], dS)
        for name, d in zip(("q", "k", "v", "g", "beta"), r[:5]):
            grads[name][c] = d
        dS = r[5]
    grads["S0"] = dS
    return grads

"""How the native chunk kernel's bf16-product error grows with the sequence length.

    python benchmarks/bf16_error_growth.py                       # the default cases
    python benchmarks/bf16_error_growth.py --seq-lens 256 1024 4096 --betas 2 --g-scales 0

bf16 inputs (B1 H2, K = V = 128, l2-normalised q/k, beta constant, g ~ U(-g_scale, 0]) through
``chunk_kda(backend="native")`` (bf16 state products where the CPU has AMX, or under
``TORCH_KDA_CHUNK_PRODUCTS=bf16`` their emulation) and ``fused_recurrent_kda(backend="native")``,
against the float64 reference on the same bf16 inputs: relative RMS error of the output and of
the final state. With little decay the state's rounding to bf16 in every chunk adds up
(docs/benchmarks.md, "The ``backend="auto"`` rule", session 18). Run from outside the source tree.
"""
import argparse

import torch

import torch_kda
from torch_kda import reference


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--betas", type=float, nargs="+", default=[1.0, 2.0])
    p.add_argument("--g-scales", type=float, nargs="+", default=[0.0, 1e-3, 1e-2])
    a = p.parse_args()
    kw = dict(use_qk_l2norm_in_kernel=True, output_final_state=True)
    print("| T | beta | g | chunk o / state | recurrent o / state |\n|---|---|---|---|---|")
    for T in a.seq_lens:
        for b in a.betas:
            for gs in a.g_scales:
                gen = torch.Generator().manual_seed(0)
                q, k, v = (torch.randn(1, T, 2, 128, generator=gen).bfloat16() for _ in range(3))
                g = (-torch.rand(1, T, 2, 128, generator=gen) * gs).bfloat16()
                beta = torch.full((1, T, 2), b).bfloat16()
                with torch.no_grad():
                    oc, sc = torch_kda.chunk_kda(q, k, v, g, beta, backend="native", **kw)
                    orr, sr = torch_kda.fused_recurrent_kda(q, k, v, g, beta, backend="native",
                                                            **kw)
                    o64, s64 = reference.fused_recurrent_kda(
                        *(t.double() for t in (q, k, v, g, beta)), **kw)
                print(f"| {T} | {b:g} | U(-{gs:g}, 0] | {rel(oc, o64):.2e} / {rel(sc, s64):.2e} "
                      f"| {rel(orr, o64):.2e} / {rel(sr, s64):.2e} |")


if __name__ == "__main__":
    main()

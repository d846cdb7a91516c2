"""Checks on a new machine before timing the chunk kernel: the CPU features the GEMM library can
use (AMX tiles, AVX-512 BF16, ATen's cpublas::could_pack for bf16) and the native chunkwise op
against the recurrent op and float64 on random inputs with strong decays (the multi-versioned
elementwise code and the GEMM kernels of this CPU), then which state products the chunk op ran
for 16-bit inputs (TORCH_KDA_CHUNK_PRODUCTS, csrc/cpu/chunk_products.h: bf16 products change
the result, so "auto" differing from "fp32" shows them) and their accuracy against float64.
Run: python benchmarks/device_chunk_check.py"""

from __future__ import annotations

import ctypes
import os

import torch

import torch_kda  # noqa: F401  (loads torch.ops.kda)


def could_pack_bf16() -> str:
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
    try:
        fn = getattr(lib, "_ZN2at6native7cpublas10could_packEN3c1010ScalarTypeE")
    except AttributeError:
        return "symbol not exported"
    fn.argtypes = [ctypes.c_int8]
    fn.restype = ctypes.c_bool
    return str(fn(15))  # c10::ScalarType::BFloat16 == 15


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main() -> None:
    cpu = torch.backends.cpu
    print("torch", torch.__version__, "capability", cpu.get_cpu_capability())
    for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported", "_is_avx512_supported"):
        f = getattr(torch.cpu, name, None)
        print(name, f() if f else "n/a")
    print("cpublas::could_pack(bf16)", could_pack_bf16())
    gen = torch.Generator().manual_seed(0)
    B, T, H, K, V = 1, 700, 4, 128, 128
    q, k = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, H, V, generator=gen)
    g = -torch.rand(B, T, H, K, generator=gen) * 0.5
    g[:, 100:110] = -1e4
    g[:, 300, :, :64] = float("-inf")
    g[:, 500] = -70.0
    beta = torch.rand(B, T, H, generator=gen)
    h0 = torch.randn(B, H, K, V, generator=gen) * 0.1
    args = lambda dt: (q.to(dt), k.to(dt), v.to(dt), g.to(dt), beta.to(dt), K ** -0.5, h0, True,
                       False, False, False, None, False, None, None, None)
    o64, s64 = torch.ops.kda.fused_recurrent(*args(torch.float64))
    oc64, sc64 = torch.ops.kda.chunk(*args(torch.float64))
    print("fp64 chunk vs recurrent: o", rel(oc64, o64), "state", rel(sc64, s64))
    for dt in (torch.float32, torch.bfloat16):
        oc, sc = torch.ops.kda.chunk(*args(dt))
        orr, sr = torch.ops.kda.fused_recurrent(*args(dt))
        print(dt, "chunk vs fp64: o", rel(oc, o64), "state", rel(sc, s64), "| recurrent vs fp64: o",
              rel(orr, o64), "state", rel(sr, s64))
    ok = rel(oc64, o64) < 1e-11 and rel(torch.ops.kda.chunk(*args(torch.float32))[0], o64) < 1e-5
    # The products for 16-bit inputs, against float64 on the same (rounded) inputs: FLA's bar is
    # 0.005 relative RMS for the output.
    knob = os.environ.get("TORCH_KDA_CHUNK_PRODUCTS")
    for dt in (torch.bfloat16, torch.float16):
        r64 = lambda x: x.to(dt).double()
        ref = torch.ops.kda.fused_recurrent(*((r64(q), r64(k), r64(v), r64(g), r64(beta))
                                              + args(torch.float64)[5:]))
        out = {}
        for mode in ("fp32", "auto", "bf16"):
            os.environ["TORCH_KDA_CHUNK_PRODUCTS"] = mode
            out[mode] = torch.ops.kda.chunk(*args(dt))
        ran = "bf16" if not torch.equal(out["auto"][0], out["fp32"][0]) else "fp32"
        print(dt, "products under auto:", ran, "| vs fp64 of the rounded inputs:",
              "; ".join(f"{m}: o {rel(o, ref[0]):.2e} state {rel(s, ref[1]):.2e}"
                        for m, (o, s) in out.items()))
        ok = ok and all(rel(o, ref[0]) < 0.005 and rel(s, ref[1]) < 0.005 for o, s in out.values())
    if knob is None:
        os.environ.pop("TORCH_KDA_CHUNK_PRODUCTS")
    else:
        os.environ["TORCH_KDA_CHUNK_PRODUCTS"] = knob
    print("CHECK", "PASS" if ok else "FAIL")


if __name__ == "__main__":
    main()

"""Does a bad argument raise a Python exception, or crash the process, on this machine?

Found on the H200 machine's host (torch 2.11.0+cu130, g++ 13.3, Ubuntu 24.04; docs/benchmarks.md,
"Known problem: shape errors crash on the device"): every shape error of the native ops
(a ValueError whose message prints tensor sizes) ended the process with SIGSEGV, while dtype errors
(TypeError) raised normally; the same code raises normally with torch 2.13 / g++ 12. Each case runs
in its own subprocess, so one crash does not hide the others:

* the native ops with a wrong k shape, a wrong v shape, a wrong k dtype, and correct inputs;
* with ``--probe``, a tiny C++ extension (torch.utils.cpp_extension.load_inline, ~30 s to build)
  that raises ValueError / TypeError / RuntimeError with and without sizes in the message, which
  tells whether the exception class or the printing of sizes is at fault.

Run: ``cd /tmp && python /path/to/torch-kda/benchmarks/device_error_probe.py [--probe]``.
Prints one line per case: the exit code (-11: SIGSEGV) and what was raised.
"""

from __future__ import annotations

import subprocess
import sys

_OP_CASE = r"""
import torch, torch_kda
g = torch.Generator().manual_seed(0)
B, T, H, K, V = 2, 6, 2, 4, 3
r = lambda *s: torch.randn(*s, generator=g)
q, k, v = r(B, T, H, K), r(B, T, H, K), r(B, T, H, V)
gate, beta = -r(B, T, H, K).abs(), r(B, T, H).sigmoid()
args = [q, k, v, gate, beta, K ** -0.5, None, False, False, False, False, None, False, None, None, None]
{change}
try:
    torch.ops.kda.{op}(*args)
    print("no error")
except Exception as e:
    print("raised", type(e).__name__, str(e).splitlines()[0][:90])
"""

_CHANGES = {
    "wrong k shape": "args[1] = args[1][..., :3]",
    "wrong v shape": "args[2] = args[2][:, :4]",
    "wrong k dtype": "args[1] = args[1].double()",
    "g > 0 (a value)": "args[3] = args[3].abs() + 0.5",
    "wrong HV": "args[2] = args[2][:, :, :1].expand(B, T, 3, V).contiguous()",
    "correct inputs": "pass",
}

_EXT = r"""
#include <torch/extension.h>
void value_plain(torch::Tensor t) { TORCH_CHECK_VALUE(false, "value plain"); }
void value_sizes(torch::Tensor t) { TORCH_CHECK_VALUE(false, "value sizes ", t.sizes()); }
void type_sizes(torch::Tensor t) { TORCH_CHECK_TYPE(false, "type sizes ", t.sizes()); }
void plain_sizes(torch::Tensor t) { TORCH_CHECK(false, "plain sizes ", t.sizes()); }
std::string format_sizes(torch::Tensor t) { return c10::str(t.sizes()); }
"""
_EXT_FUNCS = ["format_sizes", "value_plain", "value_sizes", "type_sizes", "plain_sizes"]


def _load_ext():
    from torch.utils.cpp_extension import load_inline

    return load_inline("kda_error_probe", cpp_sources=[_EXT], functions=_EXT_FUNCS,
                       extra_cflags=["-O2"], verbose=False)


def _run(code: str) -> str:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    last = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    return f"rc {r.returncode:4d}  {last}"


def main() -> None:
    import torch

    print("torch", torch.__version__)
    for op in ("fused_recurrent", "chunk"):
        for name, change in _CHANGES.items():
            print(f"kda::{op:15s} {name:15s}", _run(_OP_CASE.format(op=op, change=change)), flush=True)
    if "--probe" in sys.argv:
        _load_ext()  # build once; the subprocesses load the cached build
        for f in _EXT_FUNCS:
            code = (f"import torch, sys; sys.path.insert(0, {repr(__file__.rsplit('/', 1)[0])})\n"
                    "import device_error_probe as p\nm = p._load_ext()\n"
                    f"try:\n    print('returned', m.{f}(torch.zeros(2, 3)))\n"
                    "except Exception as e:\n    print('raised', type(e).__name__)")
            print(f"extension {f:13s}", _run(code), flush=True)


if __name__ == "__main__":
    main()

"""The CPU kernels compile without out-of-bounds array accesses that GCC can prove, per ISA.

The kernel files are built with -O3 and no warning flags (cmake/KdaKernels.cmake), and pip's
quiet builds hide what GCC prints, so a loop that GCC knows overruns an array only shows up as
wrong bits on some other machine. The case that prompted this test: V-first decode's 16-column
step (vfirst_lanes, csrc/cpu/kernels/serving_kernels.cpp) swept its value columns 4 rows at a
time into arrays of L = kL<T> rows, so with L = 2 (fp64 in the 16-byte generic kernels, which is
what every non-x86 build, e.g. aarch64, runs) it wrote zk[2], zk[3] past the end of the stack
arrays and read 2 state rows beyond the block: GCC warned "iteration 2 invokes undefined
behavior" and "array subscript 2 is above array bounds". That UB happened to give the right
numbers with GCC 12 on x86 (it dropped the iterations), so only the compiler shows it.

This compiles each kernel file for the generic ISA (the narrowest vectors, where lane-count
assumptions break first) with those two diagnostics as errors. It needs g++ and the source tree,
as the rest of the suite does (it builds and tests the native op from this checkout).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "csrc" / "cpu" / "kernels"


def _gxx():
    cxx = os.environ.get("CXX") or shutil.which("g++")
    if not cxx or not shutil.which(cxx):
        return None
    r = subprocess.run([cxx, "--version"], capture_output=True, text=True)
    return cxx if r.returncode == 0 and "clang" not in r.stdout.lower() else None


@pytest.mark.parametrize("source", ["serving_kernels.cpp", "recurrent_kernels.cpp"])
def test_generic_kernels_have_no_provable_out_of_bounds_access(source):
    cxx = _gxx()
    assert cxx is not None, "needs GCC (g++), which builds the native op (make test installs it)"
    assert (KERNELS / source).is_file(), f"needs the source tree: {KERNELS / source} is missing"
    cmd = [cxx, "-DKDA_ISA=generic", f"-I{ROOT / 'csrc'}", "-O3", "-ffp-contract=fast",
           "-Wno-psabi", "-std=gnu++17", "-Warray-bounds", "-Werror=array-bounds",
           "-Werror=aggressive-loop-optimizations", "-c", str(KERNELS / source), "-o", os.devnull]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, "\n".join(r.stderr.splitlines()[:20])

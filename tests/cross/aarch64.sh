#!/usr/bin/env bash
# The C++ library and its GoogleTest suite (the float64 oracle tests of tests/cpp, the C++ example)
# cross-compiled for 64-bit ARM (aarch64) and run under user-mode QEMU on this x86-64 machine:
# the kernels' generic (non-x86) code paths, compiled by an ARM compiler, checked on an ARM CPU
# (emulated). `make test-aarch64` runs it; docs/reliability.md "Other CPU architectures".
#
#   bash tests/cross/aarch64.sh PYTHON TORCH_VERSION [BUILD_DIR]
#
# What it sets up (once per BUILD_DIR, default build/aarch64), and why:
# - Debian/Ubuntu packages (apt-get): the cross compiler g++-aarch64-linux-gnu (its sysroot,
#   /usr/aarch64-linux-gnu, holds ARM's glibc and libstdc++), qemu-user-static, and googletest's
#   sources (the suite's GoogleTest is built for ARM from them).
# - libtorch for aarch64: the include/ and lib/ folders of PyPI's torch==TORCH_VERSION wheel for
#   manylinux_2_28_aarch64 (~430 MB download; the CUDA libraries inside are not extracted).
#   That wheel is a CUDA build: its TorchConfig.cmake asks for the CUDA toolkit, and
#   libtorch_cpu.so names libcudart / libcupti, which come from other wheels. So the build takes a
#   small TorchConfig of its own (libtorch_cpu and libc10 only), and each missing library is a
#   stub with the functions libtorch_cpu imports (never called on the CPU: the loader only needs
#   the names).
# - A root for QEMU (-L): the ARM sysroot's lib/, and a /proc/cpuinfo and sysfs CPU ids of an
#   ARM Neoverse N1, because libtorch's CPU detection (cpuinfo, oneDNN's xbyak_aarch64) reads
#   them at load time and crashes on the host's x86 ones.
set -euo pipefail

PY=${1:?usage: aarch64.sh PYTHON TORCH_VERSION [BUILD_DIR]}
TORCH_VERSION=${2:?usage: aarch64.sh PYTHON TORCH_VERSION [BUILD_DIR]}
SRC=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "${3:-build/aarch64}"
OUT=$(cd "${3:-build/aarch64}" && pwd)
JOBS=${JOBS:-2}
TRIPLE=aarch64-linux-gnu
SYSROOT=/usr/$TRIPLE

# --- tools --------------------------------------------------------------------------------------
need=()
command -v $TRIPLE-g++ >/dev/null 2>&1 || need+=(g++-$TRIPLE)
command -v qemu-aarch64-static >/dev/null 2>&1 || need+=(qemu-user-static)
[ -f /usr/src/googletest/CMakeLists.txt ] || need+=(googletest)
if ((${#need[@]})); then
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "aarch64.sh: needs ${need[*]} (Debian/Ubuntu package names; no apt-get here)" >&2
    exit 1
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

# --- libtorch for aarch64 -----------------------------------------------------------------------
TORCH=$OUT/torch
if [ ! -f "$TORCH/.done" ]; then
  rm -rf "$TORCH" "$OUT/wheel"
  "$PY" -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_28_aarch64 \
    -d "$OUT/wheel" "torch==$TORCH_VERSION"
  "$PY" - "$OUT"/wheel/torch-*.whl "$OUT" <<'PYEOF'
import re, sys, zipfile
# include/ and lib/ of the wheel's torch package, lib/ without the CUDA libraries (~1 GB).
skip = re.compile(r"cuda|cudnn|nvrtc|nvshmem|torch_python|nccl")
with zipfile.ZipFile(sys.argv[1]) as whl:
    names = [n for n in whl.namelist() if n.startswith("torch/include/")
             or n.startswith("torch/lib/") and not skip.search(n.rsplit("/", 1)[-1])]
    whl.extractall(sys.argv[2], names)
PYEOF
  rm -rf "$OUT/wheel"
  touch "$TORCH/.done"
fi

# --- stubs of the libraries libtorch_cpu names but the wheel does not hold ------------------------
STUBS=$OUT/stubs
mkdir -p "$STUBS"
for lib in $($TRIPLE-readelf -d "$TORCH/lib/libtorch_cpu.so" "$TORCH/lib/libc10.so" |
             sed -n 's/.*Shared library: \[\(.*\)\]/\1/p' | sort -u); do
  if [ -e "$TORCH/lib/$lib" ] || [ -e "$SYSROOT/lib/$lib" ] || [ -e "$STUBS/$lib" ]; then
    continue
  fi
  syms=$($TRIPLE-nm -D --undefined-only "$TORCH/lib/libtorch_cpu.so" "$TORCH/lib/libc10.so" |
         sed -n "s/^ *U \(.*\)@$lib\$/\1/p" | sort -u)
  : > "$STUBS/$lib.c"
  for s in $syms; do echo "int $s(void) { return 1; }" >> "$STUBS/$lib.c"; done
  echo "$lib { global: *; };" > "$STUBS/$lib.map"
  $TRIPLE-gcc -shared -fPIC -o "$STUBS/$lib" "$STUBS/$lib.c" -Wl,-soname,"$lib" \
    -Wl,--version-script="$STUBS/$lib.map"
  echo "aarch64.sh: stub $lib ($(echo $syms | wc -w) functions)"
done

# --- QEMU's root and the emulator ---------------------------------------------------------------
QROOT=$OUT/qemu-root
mkdir -p "$QROOT/proc"
ln -sfn "$SYSROOT/lib" "$QROOT/lib"
: > "$QROOT/proc/cpuinfo"
for cpu in 0 1; do
  mkdir -p "$QROOT/sys/devices/system/cpu/cpu$cpu/regs/identification"
  echo 0x00000000413fd0c1 > "$QROOT/sys/devices/system/cpu/cpu$cpu/regs/identification/midr_el1"
  {
    printf 'processor\t: %s\n' $cpu
    printf 'Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid\n'
    printf 'CPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x3\n'
    printf 'CPU part\t: 0xd0c\nCPU revision\t: 1\n\n'
  } >> "$QROOT/proc/cpuinfo"
done
echo 0-1 > "$QROOT/sys/devices/system/cpu/possible"
echo 0-1 > "$QROOT/sys/devices/system/cpu/present"
cat > "$OUT/qemu.sh" <<EOF
#!/bin/sh
LD_LIBRARY_PATH=$STUBS:$TORCH/lib exec qemu-aarch64-static -L $QROOT "\$@"
EOF
chmod +x "$OUT/qemu.sh"

# --- CMake: toolchain, the stand-in TorchConfig, build, suite -----------------------------------
mkdir -p "$OUT/cmake/Torch"
cat > "$OUT/cmake/toolchain.cmake" <<EOF
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER $TRIPLE-gcc)
set(CMAKE_CXX_COMPILER $TRIPLE-g++)
set(CMAKE_FIND_ROOT_PATH $SYSROOT $OUT/cmake)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)
set(CMAKE_CROSSCOMPILING_EMULATOR $OUT/qemu.sh)
EOF
cat > "$OUT/cmake/Torch/TorchConfig.cmake" <<EOF
# libtorch_cpu and libc10 of the aarch64 wheel (tests/cross/aarch64.sh says why not its own config)
set(TORCH_LIBRARY $TORCH/lib/libtorch_cpu.so)
set(TORCH_INCLUDE_DIRS $TORCH/include $TORCH/include/torch/csrc/api/include)
set(TORCH_LIBRARIES torch)
add_library(torch INTERFACE IMPORTED)
set_target_properties(torch PROPERTIES
  INTERFACE_INCLUDE_DIRECTORIES "\${TORCH_INCLUDE_DIRS}"
  INTERFACE_LINK_LIBRARIES "$TORCH/lib/libtorch_cpu.so;$TORCH/lib/libc10.so"
  INTERFACE_LINK_OPTIONS "-Wl,-rpath-link,$STUBS;-Wl,-rpath-link,$TORCH/lib"
  INTERFACE_COMPILE_DEFINITIONS "_GLIBCXX_USE_CXX11_ABI=1")
set(Torch_FOUND TRUE)
EOF
cmake -S "$SRC" -B "$OUT/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKDA_BUILD_TESTS=ON \
  -DCMAKE_TOOLCHAIN_FILE="$OUT/cmake/toolchain.cmake" -DTorch_DIR="$OUT/cmake/Torch" \
  -DFETCHCONTENT_SOURCE_DIR_GOOGLETEST=/usr/src/googletest >/dev/null
cmake --build "$OUT/build" -j "$JOBS"
$TRIPLE-readelf -h "$OUT/build/libkda.so" | grep -E "Class|Machine"
# Each test is a process of its own under QEMU (tens of times slower than native: ~6 min).
ctest --test-dir "$OUT/build" -j "$JOBS" --timeout 1200 --output-on-failure

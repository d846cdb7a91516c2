#!/usr/bin/env bash
# The wheels a user gets, installed where nothing of this checkout is visible (run by `make test`).
#
#   tests/check_wheels.sh PYTHON VENV_DIR WHEEL_DIR
#
# PYTHON has torch, scikit-build-core, CMake and Ninja (the project's .venv). VENV_DIR is a venv
# holding only the pinned torch and its dependencies (the Makefile creates it once, since
# installing torch takes a minute); each run removes torch-kda from it first, so what is checked
# is a fresh install of each wheel into an environment without this project.
#  0. an editable install of the checkout into PYTHON's env loads the native op (then the regular
#     install is restored);
#  1. the native wheel (pip wheel --no-build-isolation): a platform tag, libkda and LICENSE inside;
#     installed with its dependencies resolved by pip (torch only: tqdm and matplotlib are the
#     `cli` extra), it imports without them, available_backends()["native"] is available, the op
#     matches the reference, and `torch-kda` without the extra names the extra to install;
#  2. the pure-Python wheel (TORCH_KDA_BUILD_EXT=0): tagged py3-none-any, no binary inside, and
#     installed it runs the reference while available_backends() says why native is missing.
set -euo pipefail
ROOT=$(pwd)
abs() { case $1 in /*) echo "$1";; *) echo "$ROOT/$1";; esac; }
PY=$(abs "$1") VENV=$(abs "$2") WHEELS=$(abs "$3")
VPY=$VENV/bin/python
export CMAKE_BUILD_PARALLEL_LEVEL=${JOBS:-2}
# Run a pip command: its output only where it failed or said something (this machine's pip
# configuration warns about two unused local indexes on every call: left out).
pipq() {
  local out rc=0
  out=$("$@" 2>&1) || rc=$?
  if [ -n "$out" ]; then grep -v "^WARNING: Location" <<<"$out" || true; fi
  return $rc
}
rm -rf "$WHEELS" && mkdir -p "$WHEELS/native" "$WHEELS/pure"

echo "== editable install (pip install --no-build-isolation -e .) into PYTHON's env: loads libkda"
# scikit-build-core leaves the Python files in src/ and installs libkda into site-packages; the
# package's __path__ has both folders. The regular install is put back afterwards.
pipq "$PY" -m pip install -q --no-build-isolation --no-deps -e .
(cd "$ROOT/tests" && "$PY" - "$ROOT" <<'EOF'
import sys, torch_kda
st = torch_kda.available_backends()["native"]
assert torch_kda.__file__.startswith(sys.argv[1] + "/src/"), f"not the editable checkout: {torch_kda.__file__}"
assert st.available, f"native unavailable in the editable install: {st.reason}"
print(f"   editable: {torch_kda.__file__}, native available")
EOF
)
pipq "$PY" -m pip install -q --no-build-isolation --no-deps .

echo "== native wheel: build (reuses the CMake build folder of make install)"
"$PY" -m pip wheel -q --no-build-isolation --no-deps -w "$WHEELS/native" .
native=$(ls "$WHEELS"/native/torch_kda-*.whl)
echo "   $(basename "$native")"
case $(basename "$native") in *py3-none-any*) echo "FAIL: the native wheel is tagged pure"; exit 1;; esac
"$PY" - "$native" <<'EOF'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
assert any(n.startswith("torch_kda/libkda.") for n in names), f"no libkda in the native wheel: {names}"
assert any(n.endswith("licenses/LICENSE") or n.endswith("/LICENSE") for n in names), "no LICENSE in the wheel"
EOF

echo "== native wheel: install into $VENV and check"
"$VPY" -m pip uninstall -q -y torch-kda >/dev/null 2>&1 || true  # left over from an interrupted run
pipq "$VPY" -m pip install -q "$native"
cd "$VENV"  # far from the checkout: nothing of it can be imported
"$VPY" -W "ignore:Failed to initialize NumPy" - <<'EOF'
import importlib.util
for extra in ("tqdm", "matplotlib"):
    assert importlib.util.find_spec(extra) is None, f"{extra} came with the wheel: it belongs to the cli extra"
import torch, torch_kda
from torch_kda import fused_recurrent_kda, reference
st = torch_kda.available_backends()["native"]
assert st.available, f"native unavailable from the installed wheel: {st.reason}"
assert "site-packages" in torch_kda.__file__, torch_kda.__file__
g = torch.Generator().manual_seed(0)
q, k = torch.randn(1, 9, 2, 16, generator=g), torch.randn(1, 9, 2, 16, generator=g)
v, gate = torch.randn(1, 9, 2, 16, generator=g), -torch.rand(1, 9, 2, 16, generator=g)
beta = torch.rand(1, 9, 2, generator=g)
o, _ = fused_recurrent_kda(q, k, v, gate, beta, use_qk_l2norm_in_kernel=True, backend="native")
r, _ = reference.fused_recurrent_kda(q, k, v, gate, beta, use_qk_l2norm_in_kernel=True)
err = ((o - r).norm() / r.norm()).item()
assert err < 1e-5, err
print(f"   native available from {torch_kda.__file__}; native vs reference relative error {err:.1e}")
EOF
set +e
msg=$("$VENV/bin/torch-kda" demo 2>&1); rc=$?
set -e
if [ $rc -ne 1 ] || ! grep -q 'torch-kda\[cli\]' <<<"$msg"; then
  echo "FAIL: torch-kda demo without the cli extra: exit $rc, expected 1 and the extra named:"; echo "$msg"; exit 1
fi
echo "   torch-kda demo without tqdm/matplotlib: exit 1, names the cli extra"
cd "$ROOT"

echo "== pure-Python wheel (TORCH_KDA_BUILD_EXT=0): build, install, check"
TORCH_KDA_BUILD_EXT=0 "$PY" -m pip wheel -q --no-build-isolation --no-deps -w "$WHEELS/pure" .
pure=$(ls "$WHEELS"/pure/torch_kda-*.whl)
echo "   $(basename "$pure")"
case $(basename "$pure") in *-py3-none-any.whl) ;; *) echo "FAIL: the pure wheel is not tagged py3-none-any"; exit 1;; esac
"$PY" - "$pure" <<'EOF'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
binaries = [n for n in names if n.endswith((".so", ".dll", ".dylib", ".pyd"))]
assert not binaries, f"binaries in the pure-Python wheel: {binaries}"
EOF
"$VPY" -m pip uninstall -q -y torch-kda
pipq "$VPY" -m pip install -q "$pure"
cd "$VENV"
"$VPY" -W "ignore:Failed to initialize NumPy" - <<'EOF'
import torch, torch_kda
st = torch_kda.available_backends()["native"]
assert not st.available and "pure-Python" in st.reason, st
g = torch.Generator().manual_seed(1)
q, k, v = (torch.randn(1, 7, 2, 8, generator=g) for _ in range(3))
o, s = torch_kda.chunk_kda(q, k, v, -torch.rand(1, 7, 2, 8, generator=g), torch.rand(1, 7, 2, generator=g),
                           use_qk_l2norm_in_kernel=True, output_final_state=True)
assert o.shape == (1, 7, 2, 8) and torch.isfinite(o).all() and s.shape == (1, 2, 8, 8)
print(f"   reference runs (backend auto); native: {st.reason[:60]}...")
EOF
"$VPY" -m pip uninstall -q -y torch-kda
echo "wheels OK"

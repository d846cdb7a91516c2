"""Argument checking for the functional API: the one place where user input is validated.

Every public entry point (``torch_kda.chunk_kda``, ``torch_kda.fused_recurrent_kda``, the
reference functions, ``kda_gate``) funnels its arguments through :func:`check_kda_inputs` or
:func:`check_gate_args`, which raise ``TypeError``/``ValueError`` naming the argument, the
expected and the actual value (docs/bad_inputs.md), and return a normalised bundle.
"""

from __future__ import annotations

import functools
import math
import numbers
import warnings
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.autograd.forward_ad as _forward_ad
from torch import Tensor


def as_int(value) -> Optional[int]:
    """``value`` as a Python int where it is an integer (an int, NumPy's integer scalars: any
    ``numbers.Integral``), else None; a bool is no int here. (The int arguments once refused
    NumPy's integers: ``pad_slot_id=np.int64(-1)`` raised a TypeError.)"""
    if type(value) is int:
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


def _outside_graph(fn):
    """Run ``fn`` eagerly, outside the graph, when ``torch.compile`` traces a call to it.

    ``torch.compiler.disable`` is applied at call time, not at import: applying it imports
    torch._dynamo (and with it triton, where installed), which ``import torch_kda`` must not.
    """
    @functools.wraps(fn)
    def call(*args, **kwargs):
        if torch.compiler.is_compiling():
            return torch.compiler.disable(fn)(*args, **kwargs)
        return fn(*args, **kwargs)
    return call


_FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)
_INT_DTYPES = (torch.int64, torch.int32)
INT64_MIN, INT64_MAX = -2 ** 63, 2 ** 63 - 1  # an index's range (the native ops take int64)


@dataclass(slots=True)
class KDAInputs:
    """Checked KDA arguments plus the sizes derived from them (B, T, H, K, HV, V, N).

    Treat it as immutable (derive changed copies with ``dataclasses.replace``). Not declared
    ``frozen``: a frozen dataclass of 27 fields costs ~4 us to build (one ``object.__setattr__``
    per field), a slotted one ~0.5 us, and every call builds one.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    scale: float
    initial_state: Optional[torch.Tensor]
    output_final_state: bool
    use_qk_l2norm_in_kernel: bool
    use_gate_in_kernel: bool
    use_beta_sigmoid_in_kernel: bool
    allow_neg_eigval: bool
    safe_gate: bool
    lower_bound: Optional[float]
    state_v_first: bool
    cu_seqlens: Optional[torch.Tensor]  # int64
    A_log: Optional[torch.Tensor]
    dt_bias: Optional[torch.Tensor]
    chunk_size: int
    B: int
    T: int
    H: int
    K: int
    HV: int
    V: int
    N: int

    @property
    def compute_dtype(self) -> torch.dtype:
        """float64 for float64 ``q``, float32 otherwise (README: fp32 arithmetic, fp64 for fp64 inputs)."""
        return torch.float64 if self.q.dtype == torch.float64 else torch.float32

    @property
    def seq_bounds(self) -> List[int]:
        """``cu_seqlens`` as Python ints (a host sync on CUDA), value-checked.

        The values are checked wherever they are read, so a backend that reads them (the
        reference) rejects bad offsets also under ``torch.compile``, where
        :func:`check_kda_inputs` leaves the value checks to the consumer.
        """
        values = [int(c) for c in self.cu_seqlens.tolist()]
        check_cu_seqlens_values(values, self.T)
        return values



def _as_int64(t: Tensor) -> Tensor:
    """``t.long()`` without the dispatcher round trip when ``t`` already is int64 (every call)."""
    return t if t.dtype is torch.int64 else t.long()

def _require_tensor(name: str, x, ndim: Optional[int] = None, dtypes=_FLOAT_DTYPES) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if dtypes is not None and x.dtype not in dtypes:
        raise TypeError(f"{name} must have a dtype in {[str(d) for d in dtypes]}, got {x.dtype}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(x.shape)} ({x.dim()}-D)")


def _require_shape(name: str, x: torch.Tensor, expected: tuple, meaning: str) -> None:
    if tuple(x.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {meaning} = {tuple(expected)}, got {tuple(x.shape)}")


def _require_device(name: str, x: torch.Tensor, device: torch.device) -> None:
    if x.device != device:
        raise ValueError(f"{name} must be on the same device as q ({device}), got {x.device}")


def _finite_in_compute(x: float, dtype: torch.dtype) -> bool:
    """Whether x stays finite in the compute dtype of inputs of ``dtype`` (float64 for float64,
    float32 for the others)."""
    return math.isfinite(x) and (dtype == torch.float64 or abs(x) <= _FLOAT32_MAX)


def check_scale(scale, K: int, dtype: torch.dtype) -> float:
    """``scale`` as a float: None means ``K ** -0.5``; any real number (Python or NumPy scalar),
    finite in the compute dtype of inputs of ``dtype`` (float32 unless float64: a scale of 1e300
    would make every output NaN).

    Raises:
        TypeError: not a real number (a bool, a string, a tensor: a tensor scale would carry no
            gradient here and need a host sync, so pass ``float(scale)``).
        ValueError: NaN or infinite, or beyond float32's range for non-float64 inputs.
    """
    if scale is None:
        return K ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        hint = ""
        if isinstance(scale, torch.Tensor):
            # A 1-D tensor here is most likely A_log in FLA 0.6's positional order.
            hint = "; pass float(scale)" if scale.dim() != 1 else (
                "; a 1-D tensor as scale is likely A_log: FLA 0.6's fused_recurrent_kda takes "
                "A_log and dt_bias positionally before scale, torch-kda takes them by keyword "
                "(A_log=..., dt_bias=...)")
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__} {scale!r}{hint}")
    if not _finite_in_compute(float(scale), dtype):
        raise ValueError(f"scale must be finite (in the compute dtype: float32 unless the inputs "
                         f"are float64), got {scale!r}")
    return float(scale)


def _check_lower_bound(lower_bound, safe_gate: bool, dtype: torch.dtype) -> Optional[float]:
    if lower_bound is None:
        if safe_gate:
            raise ValueError("safe_gate=True requires lower_bound in [-5, 0), got lower_bound=None")
        return None
    if isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float)):
        raise TypeError(f"lower_bound must be a float or None, got {type(lower_bound).__name__}")
    lb = float(lower_bound)
    if not (_finite_in_compute(lb, dtype) and lb < 0):
        raise ValueError(f"lower_bound must be a finite negative float (finite in the compute "
                         f"dtype: float32 unless the inputs are float64), got {lb}")
    if safe_gate and lb < -5:
        raise ValueError(f"safe_gate=True requires -5 <= lower_bound < 0, got lower_bound={lb}")
    return lb


def _check_gate_params(g: torch.Tensor, A_log, dt_bias, lower_bound) -> None:
    HV, K = g.shape[-2], g.shape[-1]
    if A_log is None and lower_bound is None:
        raise ValueError(
            "the gate computed in the op needs A_log (softplus gate) or lower_bound (bounded gate); "
            "got A_log=None and lower_bound=None")
    # (each: one test of the valid case, the named checks where it fails; see check_kda_inputs)
    if A_log is not None and not (isinstance(A_log, Tensor) and A_log.dtype in _FLOAT_DTYPES
                                  and A_log.shape == (HV,) and A_log.device == g.device):
        _require_tensor("A_log", A_log)
        _require_shape("A_log", A_log, (HV,), "[HV]")
        _require_device("A_log", A_log, g.device)
    if dt_bias is not None and not (isinstance(dt_bias, Tensor) and dt_bias.dtype in _FLOAT_DTYPES
                                    and dt_bias.shape in ((HV * K,), (HV, K))
                                    and dt_bias.device == g.device):
        _require_tensor("dt_bias", dt_bias)
        if tuple(dt_bias.shape) not in ((HV * K,), (HV, K)):
            raise ValueError(
                f"dt_bias must have shape [HV * K] = ({HV * K},) or [HV, K] = ({HV}, {K}), "
                f"got {tuple(dt_bias.shape)}")
        _require_device("dt_bias", dt_bias, g.device)


def check_gate_args(g, A_log, dt_bias, lower_bound) -> None:
    """Check the arguments of :func:`torch_kda.kda_gate` (``g [..., HV, K]``)."""
    _require_tensor("g", g)
    if g.dim() < 2:
        raise ValueError(f"g must have at least 2 dims [..., HV, K], got shape {tuple(g.shape)}")
    _check_gate_params(g, A_log, dt_bias, _check_lower_bound(lower_bound, False, g.dtype))


def check_cu_seqlens_values(values: List[int], T: int, name: str = "cu_seqlens") -> None:
    """The value rules of ``cu_seqlens`` (starts at 0, non-decreasing, ends at ``T``).

    The one implementation, used by the functional API, the reference (where it reads the
    values), :class:`torch_kda.nn.ShortConvolution`, the layer and ``compat.flash_kda.fwd``.
    The native op checks the same rules in C++ with the same words (csrc/op_checks.cpp).
    """
    if values[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {values[0]}")
    for i in range(len(values) - 1):
        if values[i + 1] < values[i]:
            raise ValueError(
                f"{name} must be non-decreasing, got {name}[{i}] = {values[i]} > "
                f"{name}[{i + 1}] = {values[i + 1]}")
    if values[-1] != T:
        raise ValueError(f"{name}[-1] must equal T = {T}, got {values[-1]}")


def check_graph_args(use_graph, max_num_seqs, cu_seqlens) -> None:
    """FLA's CUDA-graph arguments of ``chunk_kda`` (fla-core 0.6): ``use_graph`` a bool,
    ``max_num_seqs`` None or a positive int that, with ``use_graph`` and ``cu_seqlens``, equals the
    number of sequences (FLA asserts it: a graph is captured for a fixed count).

    Raises:
        TypeError: ``use_graph`` not a bool, ``max_num_seqs`` not an int.
        ValueError: ``max_num_seqs`` < 1, or not the number of sequences of ``cu_seqlens``.
    """
    if not isinstance(use_graph, bool):
        raise TypeError(f"use_graph must be a bool, got {type(use_graph).__name__} {use_graph!r}")
    if max_num_seqs is None:
        return
    if as_int(max_num_seqs) is None:
        raise TypeError(f"max_num_seqs must be an int or None, got {type(max_num_seqs).__name__}")
    max_num_seqs = int(max_num_seqs)
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    # (a cu_seqlens that is not a 1-D tensor gets its own error from the input checks)
    one_d = isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dim() == 1
    if use_graph and one_d and cu_seqlens.numel() - 1 != max_num_seqs:
        raise ValueError(f"use_graph with max_num_seqs={max_num_seqs} needs cu_seqlens of exactly "
                         f"max_num_seqs + 1 entries (pad it with zero-length sequences), got "
                         f"{cu_seqlens.numel()} entries")


def check_cu_seqlens_cpu(cu_seqlens_cpu, cu_seqlens, q) -> None:
    """FLA's ``cu_seqlens_cpu``, the host copy of ``cu_seqlens``: the same rules, the same values.

    Raises:
        TypeError / ValueError: as :func:`check_cu_seqlens` (named ``cu_seqlens_cpu``); given
            without ``cu_seqlens``; other values than ``cu_seqlens`` (compared when
            ``cu_seqlens`` is on the CPU: no device sync).
    """
    if cu_seqlens is None:
        raise ValueError("cu_seqlens_cpu (a host copy of cu_seqlens) requires cu_seqlens, "
                         "got cu_seqlens=None")
    _require_tensor("q", q, ndim=4)
    B, T = q.shape[:2]
    check_cu_seqlens(cu_seqlens_cpu, B, T, torch.device("cpu"), name="cu_seqlens_cpu")
    _require_tensor("cu_seqlens", cu_seqlens, ndim=1, dtypes=_INT_DTYPES)
    if cu_seqlens_cpu.shape != cu_seqlens.shape or (
            cu_seqlens.device.type == "cpu" and not torch.equal(cu_seqlens_cpu.long(),
                                                                cu_seqlens.long())):
        raise ValueError(f"cu_seqlens_cpu must hold the values of cu_seqlens, got "
                         f"{cu_seqlens_cpu.tolist()} and {cu_seqlens.tolist()}")


@_outside_graph
def _check_cu_seqlens_values_outside_graph(cu_seqlens: torch.Tensor, T: int, name: str) -> None:
    # Runs eagerly even when called from compiled code (a graph break): for consumers that use
    # the offsets on the device without ever reading them on the host (ShortConvolution).
    check_cu_seqlens_values(cu_seqlens.tolist(), T, name)


def check_cu_seqlens(cu_seqlens, B: int, T: int, device: torch.device,
                     check_values: bool = True, name: str = "cu_seqlens",
                     compiled_too: bool = False) -> torch.Tensor:
    """Check packed-sequence offsets ``cu_seqlens [N + 1]`` for inputs ``[B, T, ...]``.

    Returns the offsets as int64. With ``check_values`` the values are read (a host sync on
    CUDA). While ``torch.compile`` traces, reading them would break the graph, so by default the
    consumer that reads them checks (:attr:`KDAInputs.seq_bounds`, the native op); with
    ``compiled_too`` they are checked outside the graph (a graph break).

    Raises:
        TypeError: not a tensor, or not int64/int32.
        ValueError: not 1-D, fewer than 2 entries, ``B != 1``, another device than the inputs,
            ``cu_seqlens[0] != 0``, decreasing, ``cu_seqlens[-1] != T``.
    """
    _require_tensor(name, cu_seqlens, ndim=1, dtypes=_INT_DTYPES)
    if cu_seqlens.numel() < 2:
        raise ValueError(f"{name} must have N + 1 >= 2 entries, got {cu_seqlens.numel()}")
    if B != 1:
        raise ValueError(f"with {name} the batch size B must be 1 (pack the sequences), got B={B}")
    _require_device(name, cu_seqlens, device)
    if check_values:
        if not torch.compiler.is_compiling():
            check_cu_seqlens_values(cu_seqlens.tolist(), T, name)
        elif compiled_too:
            _check_cu_seqlens_values_outside_graph(cu_seqlens, T, name)
    return _as_int64(cu_seqlens)



def _raise_tensor_errors(q, k, v, g, beta) -> None:
    """The first error among q, k, v, g, beta of these: not a tensor, dtype, rank, q/k/v dtypes
    differ. Returns when there is none (the caller then checks the shapes)."""
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g)):
        _require_tensor(name, x, ndim=4)
    _require_tensor("beta", beta, ndim=3)
    if not (k.dtype == q.dtype and v.dtype == q.dtype):
        raise TypeError(f"q, k and v must share a dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")


def _raise_shape_errors(q, k, v, g, beta) -> None:
    """The first shape error of 4-D q, k, v, g and 3-D beta (see :func:`check_kda_inputs`)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    _require_shape("k", k, (B, T, H, K), "[B, T, H, K] of q")
    if tuple(v.shape[:2]) != (B, T):
        raise ValueError(f"v must have shape [B, T, HV, V] with B, T = {B}, {T} of q, got {tuple(v.shape)}")
    for dim_name, size, source in (("K", K, "q.shape[3]"), ("V", V, "v.shape[3]"), ("HV", HV, "v.shape[2]")):
        if size == 0:
            raise ValueError(f"the {dim_name} dimension ({source}) must be positive, got {dim_name}=0")
    if H == 0 or HV % H != 0:
        raise ValueError(f"the value heads HV must be a positive multiple of the query/key heads H, "
                         f"got HV={HV}, H={H} (from v.shape[2] and q.shape[2])")
    _require_shape("g", g, (B, T, HV, K), "[B, T, HV, K]")
    _require_shape("beta", beta, (B, T, HV), "[B, T, HV]")
    raise AssertionError("unreachable: every shape check passed")  # the caller's test failed


def check_kda_inputs(
    q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
    use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound,
    state_v_first, cu_seqlens, A_log, dt_bias, chunk_size: int = 64,
) -> KDAInputs:
    """Validate the arguments of ``chunk_kda``/``fused_recurrent_kda`` (see their docstrings).

    Raises:
        TypeError: a non-tensor or a non-floating tensor, ``q``/``k``/``v`` of different dtypes,
            non-integer ``cu_seqlens``, a flag that is not a ``bool``.
        ValueError: any shape, device, ``cu_seqlens``, gate or flag inconsistency; the message names
            the argument, the expected and the actual value.
    """
    # The valid case is recognised by one cheap test (each tensor attribute read once); the named
    # checks, which build the messages, run only where it fails (a decode loop calls this on
    # every token: docs/benchmarks.md "Decode: the Python layer, fourth round").
    if not (isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)
            and isinstance(g, Tensor) and isinstance(beta, Tensor)
            and q.dtype in _FLOAT_DTYPES and k.dtype is q.dtype and v.dtype is q.dtype
            and g.dtype in _FLOAT_DTYPES and beta.dtype in _FLOAT_DTYPES):
        _raise_tensor_errors(q, k, v, g, beta)
    shape, v_shape = q.shape, v.shape
    if not (len(shape) == 4 and len(v_shape) == 4):
        _raise_tensor_errors(q, k, v, g, beta)
    B, T, H, K = shape
    _, _, HV, V = v_shape
    # (k, g, beta compared with full shapes: their ranks are checked too)
    if not (k.shape == shape and v_shape[0] == B and v_shape[1] == T and K and V and HV and H
            and HV % H == 0 and g.shape == (B, T, HV, K) and beta.shape == (B, T, HV)):
        _raise_tensor_errors(q, k, v, g, beta)
        _raise_shape_errors(q, k, v, g, beta)
    # One device for all (CPU tensors: one flag each; other devices compared as objects)
    on_cpu = q.is_cpu and k.is_cpu and v.is_cpu and g.is_cpu and beta.is_cpu
    if not on_cpu:
        device = q.device
        if device.type == "meta":
            # Every backend reads values (checks of cu_seqlens and of the value domain, the
            # kernels): there are none on the meta device. torch.compile traces with fake tensors
            # instead, through the native op's Meta kernels.
            raise ValueError("q is on the meta device, which holds no values; torch_kda computes "
                             "and checks values on CPU or CUDA tensors (to trace shapes, "
                             "torch.compile the call: the native ops have Meta kernels)")
        for name, x in (("k", k), ("v", v), ("g", g), ("beta", beta)):
            _require_device(name, x, device)

    if not (type(output_final_state) is bool and type(use_qk_l2norm_in_kernel) is bool
            and type(use_gate_in_kernel) is bool and type(use_beta_sigmoid_in_kernel) is bool
            and type(allow_neg_eigval) is bool and type(safe_gate) is bool
            and type(state_v_first) is bool):
        # (a string "False" or a one-element tensor would otherwise be read by its truth value)
        for name, flag in (("output_final_state", output_final_state),
                           ("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel),
                           ("use_gate_in_kernel", use_gate_in_kernel),
                           ("use_beta_sigmoid_in_kernel", use_beta_sigmoid_in_kernel),
                           ("allow_neg_eigval", allow_neg_eigval), ("safe_gate", safe_gate),
                           ("state_v_first", state_v_first)):
            _require_bool(name, flag)
    scale = check_scale(scale, K, q.dtype)
    if lower_bound is not None or safe_gate:
        lower_bound = _check_lower_bound(lower_bound, safe_gate, q.dtype)
    if use_gate_in_kernel:
        _check_gate_params(g, A_log, dt_bias, lower_bound)
    elif A_log is not None or dt_bias is not None:
        raise ValueError("A_log and dt_bias are only used with use_gate_in_kernel=True; got "
                         f"use_gate_in_kernel=False with A_log={'set' if A_log is not None else None}, "
                         f"dt_bias={'set' if dt_bias is not None else None}")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True "
                         "(beta = 2 * sigmoid(logits)); got use_beta_sigmoid_in_kernel=False")
    if as_int(chunk_size) is None or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    chunk_size = int(chunk_size)

    if cu_seqlens is not None:
        cu_seqlens = check_cu_seqlens(cu_seqlens, B, T, q.device)
        N = cu_seqlens.numel() - 1
    else:
        N = B
    if initial_state is not None:
        expected = (N, HV, V, K) if state_v_first else (N, HV, K, V)
        if not (isinstance(initial_state, Tensor) and initial_state.dtype in _FLOAT_DTYPES
                and initial_state.shape == expected
                and (initial_state.is_cpu if on_cpu else initial_state.device == q.device)):
            _require_tensor("initial_state", initial_state, ndim=4)
            meaning = "[N, HV, V, K] (state_v_first=True)" if state_v_first else "[N, HV, K, V]"
            _require_shape("initial_state", initial_state, expected, meaning)
            _require_device("initial_state", initial_state, q.device)

    return KDAInputs(q, k, v, g, beta, float(scale), initial_state, output_final_state,
                     use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                     allow_neg_eigval, safe_gate, lower_bound, state_v_first, cu_seqlens, A_log,
                     dt_bias, chunk_size,
                     B, T, H, K, HV, V, N)


# ---- serving arguments (state pool, slot indices, speculative decoding) -------------------------

_POOL_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(slots=True)  # treat as immutable; not frozen for the cost of building it (see KDAInputs)
class ServingArgs:
    """Checked serving arguments of ``fused_recurrent_kda`` / ``chunk_kda`` (docs/serving.md).

    ``read_slots[n]`` is the pool slot sequence ``n`` starts from (``None``: no pool, the state is
    ``initial_state[n]`` or zeros), ``is_pad[n]`` marks pad sequences (zero output, nothing
    written); ``snapshot_slots[n][t]`` is the slot that receives the state after token ``t``
    (2-D indices; ``None`` entries write nothing); ``final_slots[n]`` the slot that receives the
    final state (in-place calls with 1-D or no indices). Host lists, computed once here.
    """

    ssm_state_indices: Optional[torch.Tensor]   # int64, [N] or [N, T_max]
    num_accepted_tokens: Optional[torch.Tensor]  # int64 [N]
    inplace_final_state: bool
    out: Optional[torch.Tensor]
    pad_slot_id: int
    return_intermediate_states: bool
    beta_headwise: bool
    read_slots: List[Optional[int]]
    is_pad: List[bool]
    snapshot_slots: Optional[List[List[Optional[int]]]]
    final_slots: Optional[List[Optional[int]]]
    seq_lens: List[int]

    @property
    def uses_pool(self) -> bool:
        """True when ``initial_state`` is a pool addressed by ``ssm_state_indices``."""
        return self.ssm_state_indices is not None


def _require_bool(name: str, x) -> bool:
    if not isinstance(x, bool):
        t = type(x)
        # qualified outside builtins: numpy's bool is named "bool" too
        kind = t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"
        raise TypeError(f"{name} must be a bool, got {kind} {x!r}")
    return x


def _inference_only(what: str, why: str, tensors, alternative: str = "") -> None:
    """Refuse ``what`` under grad mode when one of ``tensors`` (``(name, tensor or None)``)
    requires grad: its result would carry no graph. Raises ValueError naming the tensor."""
    if not torch.is_grad_enabled():
        return
    for name, t in tensors:
        if _requires_grad(t):
            raise ValueError(f"{what} is inference only ({why}), but {name} requires grad; call "
                             f"it under torch.no_grad() / torch.inference_mode()"
                             f"{', ' + alternative if alternative else ''}")


def _sequence_lengths(x: KDAInputs) -> List[int]:
    if x.cu_seqlens is None:
        return [x.T] * x.B
    b = x.seq_bounds
    return [b[i + 1] - b[i] for i in range(len(b) - 1)]


def _requires_grad(t) -> bool:
    return isinstance(t, torch.Tensor) and t.requires_grad


def _functorch_active() -> bool:
    """Whether a torch.func transform is running: native ops called inside one see functorch's
    tensors (no storage), not plain ones."""
    peek = getattr(torch._C._functorch, "peek_interpreter_stack", None)
    return peek is not None and peek() is not None


def forward_ad_active() -> bool:
    """Whether a forward-mode dual level is open (``torch.autograd.forward_ad.dual_level``, also
    inside ``torch.func.jvp``): one attribute read, cheap enough for every decode call."""
    return getattr(_forward_ad, "_current_level", -1) >= 0


def has_tangent(t) -> bool:
    """Whether ``t`` carries a forward-mode tangent at the current dual level."""
    return (forward_ad_active() and isinstance(t, torch.Tensor)
            and _forward_ad.unpack_dual(t).tangent is not None)


def _transformed(t) -> bool:
    """Whether ``t`` is a functorch wrapper (inside ``torch.func.jvp`` / ``vmap`` / ``grad``) or
    carries a forward-mode tangent (``torch.autograd.forward_ad``): the native library cannot
    read the first and drops the second."""
    if isinstance(t, torch.Tensor) and torch._C._functorch.is_functorch_wrapped_tensor(t):
        return True
    return has_tangent(t)


def check_serving_inputs(
    q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
    use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound,
    state_v_first, cu_seqlens, A_log, dt_bias, chunk_size: int = 64, *,
    ssm_state_indices=None, num_accepted_tokens=None, inplace_final_state=False, out=None,
    pad_slot_id=-1, return_intermediate_states=False, method: str = "recurrent",
) -> "tuple[KDAInputs, Optional[ServingArgs]]":
    """Validate the KDA arguments plus the serving ones (FLA's ``fused_recurrent_kda_fwd`` names).

    Returns ``(x, serving)``; ``serving`` is None when no serving argument is in use (the plain
    call, checked by :func:`check_kda_inputs` alone). ``method`` is ``"recurrent"``
    (``fused_recurrent_kda``: 1-D or 2-D indices, ``num_accepted_tokens``, head-wise beta) or
    ``"chunk"`` (``chunk_kda``: 1-D indices, ``return_intermediate_states``).

    Raises:
        TypeError: non-tensor / non-integer indices, non-bool flags, non-int ``pad_slot_id``,
            ``out`` of another dtype than ``q``.
        ValueError: shapes, an index outside ``[0, num_slots)`` (and not ``pad_slot_id``), two
            sequences writing one slot (or one writing a slot another reads),
            ``num_accepted_tokens`` outside ``[1, T_n]``, sequences longer than ``T_max``, a pool
            dtype/shape/layout mismatch, in-place calls on tensors that require grad (serving is
            inference only). Nothing is written before these checks pass.
    """
    if as_int(pad_slot_id) is None:
        raise TypeError(f"pad_slot_id must be an int, got {type(pad_slot_id).__name__} {pad_slot_id!r}")
    pad_slot_id = int(pad_slot_id)
    if not INT64_MIN <= pad_slot_id <= INT64_MAX:  # (no index could match it)
        raise ValueError(f"pad_slot_id must fit in int64, got {pad_slot_id}")
    if type(inplace_final_state) is not bool:
        _require_bool("inplace_final_state", inplace_final_state)
    if type(return_intermediate_states) is not bool:
        _require_bool("return_intermediate_states", return_intermediate_states)
    headwise = isinstance(beta, torch.Tensor) and beta.dim() == 4
    if headwise and beta.shape[3] == 0:  # before beta[..., 0] stands in for it below
        raise ValueError("head-wise beta [B, T, HV, V] needs V = v.shape[3] > 0 columns, got shape "
                         f"{tuple(beta.shape)}")
    active = (ssm_state_indices is not None or num_accepted_tokens is not None or inplace_final_state
              or out is not None or headwise or return_intermediate_states)
    for name, index in (("ssm_state_indices", ssm_state_indices),
                        ("num_accepted_tokens", num_accepted_tokens)):
        if index is not None and not isinstance(index, torch.Tensor):  # (a list failed below)
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(index).__name__}")
    if not active:
        x = check_kda_inputs(q, k, v, g, beta, scale, initial_state, output_final_state,
                             use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                             allow_neg_eigval, safe_gate, lower_bound, state_v_first, cu_seqlens,
                             A_log, dt_bias, chunk_size)
        return x, None
    if method == "chunk":
        if headwise:
            raise ValueError("beta must be 3-D [B, T, HV] for chunk_kda (head-wise beta [B, T, HV, V] "
                             f"is a fused_recurrent_kda feature), got shape {tuple(beta.shape)} (4-D)")
        if num_accepted_tokens is not None:
            raise ValueError("chunk_kda takes 1-D ssm_state_indices only; num_accepted_tokens "
                             "(speculative decoding) is a fused_recurrent_kda argument, got a tensor")
    elif return_intermediate_states:
        raise ValueError("return_intermediate_states is a chunk_kda argument; fused_recurrent_kda "
                         "writes per-token snapshots through 2-D ssm_state_indices instead")
    pooled = ssm_state_indices is not None
    # The plain checks, with the pool and a head-wise beta replaced by what they check.
    x = check_kda_inputs(q, k, v, g, beta[..., 0] if headwise else beta, scale,
                         None if pooled else initial_state, output_final_state,
                         use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                         allow_neg_eigval, safe_gate, lower_bound, state_v_first, cu_seqlens, A_log,
                         dt_bias, chunk_size)
    B, T, HV, K, V, N = x.B, x.T, x.HV, x.K, x.V, x.N
    if headwise and tuple(beta.shape) != (B, T, HV, V):
        raise ValueError(f"beta must be 3-D [B, T, HV] = {(B, T, HV)} or head-wise 4-D [B, T, HV, V] = "
                         f"{(B, T, HV, V)}, got shape {tuple(beta.shape)}")
    layout = "[num_slots, HV, V, K] (state_v_first=True)" if state_v_first else "[num_slots, HV, K, V]"
    per_slot = (HV, V, K) if state_v_first else (HV, K, V)
    if pooled or inplace_final_state:
        if initial_state is None:
            what = "ssm_state_indices" if pooled else "inplace_final_state=True"
            raise ValueError(f"{what} needs the state pool as initial_state {layout}, got None")
        _require_tensor("initial_state", initial_state, ndim=4)
        _require_device("initial_state", initial_state, x.q.device)
        if tuple(initial_state.shape[1:]) != per_slot:
            raise ValueError(f"initial_state (the state pool) must have shape {layout} = "
                             f"(num_slots, {', '.join(map(str, per_slot))}), got {tuple(initial_state.shape)}")
        allowed = _POOL_DTYPES + ((torch.float64,) if x.q.dtype == torch.float64 else ())
        if initial_state.dtype not in allowed:
            raise TypeError(f"the state pool (initial_state) must have a dtype in "
                            f"{[str(d) for d in allowed]}, got {initial_state.dtype}")
    num_slots = initial_state.shape[0] if initial_state is not None else 0
    if inplace_final_state:
        inner = initial_state.stride()[1:]
        expected_inner = (per_slot[1] * per_slot[2], per_slot[2], 1)
        if tuple(inner) != expected_inner:
            raise ValueError("inplace_final_state=True needs each slot of the pool contiguous "
                             f"(strides (*, {', '.join(map(str, expected_inner))})), got strides "
                             f"{tuple(initial_state.stride())}")
    # Arguments whose results autograd cannot follow: with any input requiring grad they would
    # return values without a graph (gradients silently missing), so they are refused.
    inputs = (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta),
              ("initial_state", initial_state), ("A_log", A_log), ("dt_bias", dt_bias))
    if inplace_final_state:
        _inference_only("inplace_final_state=True", "serving updates the pool in place, which "
                        "autograd cannot differentiate", inputs, "or use inplace_final_state=False")
    if return_intermediate_states:
        _inference_only("return_intermediate_states=True", "prefix caching", inputs)
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
        _require_shape("out", out, (B, T, HV, V), "[B, T, HV, V]")
        if out.dtype != x.q.dtype:
            raise TypeError(f"out must have the dtype of q ({x.q.dtype}), got {out.dtype}")
        _require_device("out", out, x.q.device)
        _inference_only("out=", "it is written in place, outside autograd, as PyTorch's out= "
                        "arguments", (("out", out),) + inputs, "or leave out=None")

    written = {"out": out} if out is not None else {}
    if inplace_final_state:
        written["initial_state"] = initial_state
    if written and any(_transformed(t) for t in (q, k, v, g, beta, initial_state, A_log, dt_bias,
                                                out)):
        # the pool and out could carry no tangent (forward_ad dropped the pool's; under
        # torch.func the writes reach functorch's wrappers): refused like gradients are
        raise ValueError("in-place serving (inplace_final_state=True, out=) is inference only and "
                         "cannot run under forward-mode AD (torch.autograd.forward_ad) or "
                         "torch.func transforms (jvp, vmap, grad); call it on plain tensors, or "
                         "with inplace_final_state=False and out=None")
    if written:
        if not torch.is_inference_mode_enabled():
            # PyTorch refuses an in-place update of an inference tensor outside inference mode
            # only after the write (the version bump): refused here, before anything is written.
            for name, t in written.items():
                if t.is_inference():
                    raise ValueError(f"{name} was made under inference mode and is written in "
                                     "place here, outside it; call under torch.inference_mode(), "
                                     f"or make {name} outside inference mode")
        read = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": initial_state,
                "A_log": A_log, "dt_bias": dt_bias, "cu_seqlens": cu_seqlens,
                "ssm_state_indices": ssm_state_indices, "num_accepted_tokens": num_accepted_tokens}
        check_no_aliasing(written, read)

    seq_lens = _sequence_lengths(x)
    nat = None
    if num_accepted_tokens is not None:
        if not pooled or ssm_state_indices.dim() != 2:
            raise ValueError("num_accepted_tokens (speculative decoding) needs 2-D ssm_state_indices "
                             "[N, T_max], got " + ("None" if not pooled else
                                                  f"shape {tuple(ssm_state_indices.shape)}"))
        _require_tensor("num_accepted_tokens", num_accepted_tokens, ndim=1, dtypes=_INT_DTYPES)
        _require_shape("num_accepted_tokens", num_accepted_tokens, (N,), "[N]")
        _require_device("num_accepted_tokens", num_accepted_tokens, x.q.device)
        nat = [int(a) for a in num_accepted_tokens.tolist()]
        num_accepted_tokens = _as_int64(num_accepted_tokens)

    read_slots: List[Optional[int]] = [None] * N
    is_pad = [False] * N
    snapshot_slots = None
    final_slots = None
    if pooled:
        idx = ssm_state_indices
        _require_tensor("ssm_state_indices", idx, dtypes=_INT_DTYPES)
        _require_device("ssm_state_indices", idx, x.q.device)
        if idx.dim() not in (1, 2) or idx.shape[0] != N:
            raise ValueError(f"ssm_state_indices must have shape [N] or [N, T_max] with N = {N} "
                             f"sequences, got {tuple(idx.shape)}")
        if idx.dim() == 2 and method == "chunk":
            raise ValueError("chunk_kda takes 1-D ssm_state_indices [N]; 2-D indices (per-token "
                             f"snapshots) are a fused_recurrent_kda argument, got shape {tuple(idx.shape)}")
        if idx.dim() == 2 and not inplace_final_state:
            raise ValueError("2-D ssm_state_indices write per-token snapshots into the pool and need "
                             "inplace_final_state=True, got inplace_final_state=False")
        values = idx.tolist()

        def slot(v_: int, where: str) -> Optional[int]:
            if v_ == pad_slot_id:
                return None
            if not 0 <= v_ < num_slots:
                raise ValueError(f"ssm_state_indices{where} = {v_} is out of range: expected a slot "
                                 f"in [0, {num_slots}) (num_slots = initial_state.shape[0]) or "
                                 f"pad_slot_id = {pad_slot_id}")
            return v_

        writes: dict = {}

        def claim(s: Optional[int], n: int, where: str) -> None:
            if s is None:
                return
            other, other_where = writes.setdefault(s, (n, where))
            if other != n:
                raise ValueError(f"two sequences write slot {s} in one call (sequences {other} and "
                                 f"{n}, at ssm_state_indices{where}); each slot may be written by "
                                 "one sequence only")
            if other_where != where:
                # Two snapshots of one row in one slot: the later one would silently replace the
                # state that num_accepted_tokens may name on the next call.
                raise ValueError(f"sequence {n} writes slot {s} twice (at ssm_state_indices"
                                 f"{other_where} and {where}); each token's snapshot needs its "
                                 "own slot")

        if idx.dim() == 1:
            for n in range(N):
                read_slots[n] = slot(values[n], f"[{n}]")
                is_pad[n] = read_slots[n] is None
            if inplace_final_state:
                final_slots = list(read_slots)
                for n in range(N):
                    claim(final_slots[n], n, f"[{n}]")
        else:
            T_max = idx.shape[1]
            snapshot_slots = []
            for n in range(N):
                T_n = seq_lens[n]
                if T_n > T_max:
                    raise ValueError(f"sequence {n} has {T_n} tokens but ssm_state_indices has "
                                     f"T_max = {T_max} columns (shape {tuple(idx.shape)})")
                a = 1 if nat is None else nat[n]
                if T_n > 0 and not 1 <= a <= T_n:
                    raise ValueError(f"num_accepted_tokens[{n}] must be in [1, T_n] = [1, {T_n}], got {a}")
                row = [slot(values[n][t], f"[{n}, {t}]") for t in range(T_n)]
                if T_n == 0:
                    read_slots[n], is_pad[n] = None, True  # nothing to read, write or output
                else:
                    read_slots[n] = row[a - 1]
                    is_pad[n] = row[a - 1] is None
                snapshot_slots.append([] if is_pad[n] else row)
                for t, s in enumerate(snapshot_slots[n]):
                    claim(s, n, f"[{n}, {t}]")
        for n in range(N):
            s = read_slots[n]
            if s is not None and writes.get(s, (n,))[0] != n:
                raise ValueError(f"slot {s} is read by sequence {n} and written by sequence "
                                 f"{writes[s][0]} in the same call; give each sequence its own slots")
        ssm_state_indices = _as_int64(idx)
    elif inplace_final_state:
        final_slots = list(range(N))  # initial_state [N, ...] updated in place, row n <- sequence n

    x.initial_state, x.beta = initial_state, beta  # the pool, head-wise beta (x is ours, new)
    return x, ServingArgs(ssm_state_indices, num_accepted_tokens, inplace_final_state, out,
                          pad_slot_id, return_intermediate_states, headwise, read_slots, is_pad,
                          snapshot_slots, final_slots, seq_lens)


def _byte_span(t: torch.Tensor):
    """``(first, end)`` byte addresses that ``t``'s elements can occupy; None when empty."""
    nbytes = t.nbytes
    if nbytes == 0:
        return None
    first = t.data_ptr()
    if t.is_contiguous():  # the usual case, in three reads (a decode loop checks ~10 per call)
        return first, first + nbytes
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return first, first + (last + 1) * t.element_size()


def _may_self_overlap(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may share memory (a stride 0, or slots that overlap).

    Sufficient test for separate elements: sorted by stride, each stride exceeds the largest
    offset that the smaller ones reach. Every view made by slicing, permuting and (non-zero)
    striding a fresh tensor passes it."""
    reach = 0
    for stride, size in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n > 1):
        if stride <= reach:
            return True
        reach += (size - 1) * stride
    return False


@_outside_graph  # reads data pointers: eagerly, outside the graph, under torch.compile
def check_no_aliasing(written: dict, read: dict) -> None:
    """Reject a call whose in-place outputs alias themselves, each other or an input.

    ``written`` maps argument names to the tensors a call writes in place (``out``, the state pool
    with ``inplace_final_state``, a caller's ``final_state``); ``read`` to every tensor it reads
    (None entries are skipped; a name present in both is checked as written only). The native
    kernels write while other threads still read: an ``out`` that is ``q`` or an expanded pool
    returned wrong values without a word (docs/bad_inputs.md). Overlap is judged by the byte
    ranges the tensors span, so interleaved views of one buffer (``x[..., ::2]``, ``x[..., 1::2]``)
    count as overlapping too.

    Raises:
        ValueError: naming the tensors (and the strides of a self-overlapping one).
    """
    items = [(name, t) for name, t in written.items() if t is not None]
    for name, t in items:
        if t.is_meta or not _may_self_overlap(t):
            continue
        if name == "initial_state":
            raise ValueError(
                f"the slots of the state pool (initial_state) overlap in memory (shape "
                f"{tuple(t.shape)}, strides {tuple(t.stride())}; an expanded tensor?), so two slot "
                "indices could name one state that inplace_final_state=True writes; pass a pool "
                "whose slots are separate (e.g. initial_state.contiguous())")
        raise ValueError(f"{name} has elements that share memory (shape {tuple(t.shape)}, strides "
                         f"{tuple(t.stride())}; an expanded tensor?), and it is written in place; "
                         "pass a tensor of separate elements (e.g. torch.empty)")
    others = items + [(name, t) for name, t in read.items()
                      if t is not None and name not in written]
    # each tensor's device and byte span once (None: a meta or empty tensor, which nothing overlaps)
    spans = [(name, t.device, None if t.is_meta else _byte_span(t)) for name, t in others]
    for i in range(len(items)):
        name, device, span = spans[i]
        if span is None:
            continue
        for other_name, o_device, o_span in spans[i + 1:]:
            if o_span is not None and o_device == device and o_span[0] < span[1] and span[0] < o_span[1]:
                raise ValueError(
                    f"{name} shares memory with {other_name}: it is written in place while the "
                    f"call reads {other_name}, which would corrupt the result; pass a separate "
                    f"tensor as {name}")


def _index(flat: int, shape) -> str:
    idx = []
    for size in reversed(shape):
        idx.append(flat % size)
        flat //= size
    return "[" + ", ".join(str(i) for i in reversed(idx)) + "]"


def check_value_domain(x: KDAInputs) -> None:
    """Reject values outside the domain where the recurrence is defined (docs/bad_inputs.md).

    For the backends that are not the native op (the reference, FLA): the native op makes the
    same checks inside its pre-processing pass, at no measurable cost; here they cost one
    reduction over ``g`` and one over ``beta``, each followed by a host sync on CUDA. NaN is not
    rejected (it propagates, by policy). Under ``torch.compile`` it runs eagerly, outside the
    graph (a graph break; compile users: use the native backend, docs/layer.md). Also runs
    :func:`warn_unstable_writes`.

    Raises:
        ValueError: ``g > 0`` without ``use_gate_in_kernel`` (a log-decay must be <= 0); ``beta``
            outside ``[0, 2]`` without ``use_beta_sigmoid_in_kernel``.
    """
    # With the in-op gate, sigmoid and l2 norm (the layer's call) there is nothing to check and
    # nothing leaves the graph.
    if not (x.use_gate_in_kernel and x.use_beta_sigmoid_in_kernel):
        _check_value_domain(x)
    warn_unstable_writes(x)


@_outside_graph  # data-dependent: runs eagerly under torch.compile (a graph break)
def _check_value_domain(x: KDAInputs) -> None:
    with torch.no_grad():
        if not x.use_gate_in_kernel:
            bad = x.g > 0
            if bool(bad.any()):
                flat = int(bad.flatten().nonzero()[0])
                raise ValueError(
                    f"g must be a log-decay <= 0 with use_gate_in_kernel=False, got "
                    f"g{_index(flat, x.g.shape)} = {x.g.flatten()[flat].item():g}; pass log(decay) "
                    "for a decay in (0, 1], or the raw gate input with use_gate_in_kernel=True and "
                    "A_log")
        if not x.use_beta_sigmoid_in_kernel:
            bad = (x.beta < 0) | (x.beta > 2)
            if bool(bad.any()):
                flat = int(bad.flatten().nonzero()[0])
                raise ValueError(
                    f"beta must lie in [0, 2] with use_beta_sigmoid_in_kernel=False, got "
                    f"beta{_index(flat, x.beta.shape)} = {x.beta.flatten()[flat].item():g}; pass "
                    "use_beta_sigmoid_in_kernel=True if beta holds logits")


def warn_unstable_writes(x: KDAInputs, flat: Optional[int] = None) -> None:
    """Warn when a write step can amplify the state: ``beta * ||k||^2 > 2`` (every backend).

    The write ``S <- (I - beta k k^T) S' + ...`` scales the state along ``k`` by
    ``1 - beta ||k||^2``, outside ``[-1, 1]`` exactly when ``beta ||k||^2 > 2`` (or < 0, which
    the ``beta`` range rules out). With ``use_qk_l2norm_in_kernel`` ``||k||^2 < 1`` and
    ``beta <= 2``, so nothing is computed then; without it this costs one reduction over ``k`` and
    ``beta`` (and a host sync on CUDA), on CPU tensors one call of the native library's
    ``kda::_unstable_write`` when it is loaded, and nothing more for the native recurrent backend,
    whose op finds the place itself (``kda::_fused_recurrent_checked``; for ``fused_recurrent_kda``'s
    native calls ``kda::_fused_recurrent_fast`` / ``kda::_fused_recurrent_serving_fast``) and passes
    it as ``flat``.
    A warning, not an error: decays can still keep such a state bounded. It is raised here, in
    Python, for the native backend too: a ``TORCH_WARN`` from an op called through ``torch.ops``
    goes to stderr, not to Python's ``warnings``.

    Args:
        flat: the first offending flat index of ``x.beta`` when the caller has found it.

    Warns:
        UserWarning: naming the place, the values and ``use_qk_l2norm_in_kernel=True``.
    """
    if x.use_qk_l2norm_in_kernel:
        return
    if (flat is None and x.k.is_cpu and not torch.compiler.is_compiling()
            and not _functorch_active() and not _transformed(x.k) and not _transformed(x.beta)):
        op = _native_unstable_write()
        # CPU: one pass of the native library (csrc/cpu/unstable_writes.cpp) instead of about six
        # ATen dispatches; a decode loop runs this on every call.
        if op is not None:
            flat = op(x.k, x.beta, x.use_beta_sigmoid_in_kernel, 2.0 if x.allow_neg_eigval else 1.0)
            if flat < 0:
                return
    _warn_unstable_writes(x, flat)


_UNSTABLE_WRITE = None  # the op's callable, looked up once (_native_unstable_write)


def _native_unstable_write():
    """``kda::_unstable_write``'s direct callable (``_native.direct``) when the native library is
    loaded, else None. Called only outside ``torch.compile`` (:func:`warn_unstable_writes`)."""
    global _UNSTABLE_WRITE
    if _UNSTABLE_WRITE is None:
        from . import _native  # here, not at the top: _native imports this module

        if _native.LOAD_ERROR is not None:
            return None
        _UNSTABLE_WRITE = _native.direct("_unstable_write")
    return _UNSTABLE_WRITE


@_outside_graph  # data-dependent: runs eagerly under torch.compile (a graph break)
def _warn_unstable_writes(x: KDAInputs, flat: Optional[int]) -> None:
    # The ATen form of the check (CUDA tensors, no native library) when flat is None, and the
    # values of the message.
    with torch.no_grad():
        ct = x.compute_dtype
        k = x.k if x.k.dtype == ct else x.k.to(ct)
        beta = x.beta if x.beta.dtype == ct else x.beta.to(ct)
        if x.use_beta_sigmoid_in_kernel:
            beta = torch.sigmoid(beta) * (2.0 if x.allow_neg_eigval else 1.0)
        # [B, T, H]. One reduction pass: vecdot materialises k * k first (a fresh [B, T, H, K]
        # temporary: 32 MB at T = 4K, H = 16, all pages faulted in, ~10x the time of the norm).
        kn2 = torch.linalg.vector_norm(k, dim=-1).square_()
        if beta.dim() == 3 and x.HV == x.H:  # beta [B, T, H] too: no views (each op costs us)
            grouped = tuple(beta.shape)
        else:  # beta [B, T, HV(, V)] grouped by key head: [B, T, H, HV // H(, V)], beta's order
            grouped = (x.B, x.T, x.H, x.HV // x.H) + tuple(beta.shape[3:])
            kn2 = kn2.view(x.B, x.T, x.H, *([1] * (len(grouped) - 3)))
            beta = beta.reshape(grouped)
        if flat is None:
            # 2 plus rounding (as kda::_unstable_write): keys normalised by the caller have
            # ||k||^2 = 1 + their rounding, and beta = 2 is allowed: 32 ulp of the compute
            # dtype, or one ulp of k's own dtype (bf16 keys land ~1e-4..1e-3 above 1).
            tol = max(32 * torch.finfo(ct).eps, torch.finfo(x.k.dtype).eps)
            bad = (beta * kn2).gt_(2 * (1 + tol))
            if not bool(bad.any()):
                return
            flat = int(bad.flatten().nonzero()[0])
        b, n2 = beta.flatten()[flat].item(), kn2.expand(grouped).flatten()[flat].item()
        warnings.warn(
            f"beta * ||k||^2 = {b * n2:g} > 2 at {_index(flat, x.beta.shape)} (beta = {b:g}, "
            f"||k||^2 = {n2:g}): the write step's factor 1 - beta * ||k||^2 lies outside "
            "[-1, 1], so the state can grow without bound; pass "
            "use_qk_l2norm_in_kernel=True (or keep ||k||^2 <= 2 / beta)",
            UserWarning, stacklevel=5)

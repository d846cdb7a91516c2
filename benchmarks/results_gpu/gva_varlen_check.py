# GPU spot check: chunk_kda(backend="fla") with GVA + cu_seqlens + in-op gate/norm/sigmoid vs the native CPU op.
import sys
import torch, torch_kda
sys.path.insert(0, "/tmp/src/benchmarks")
from bench_gpu import fast_autotune
torch.manual_seed(0)
H, HV, K, V = 2, 4, 128, 128
lens = [100, 37, 1, 200]
T = sum(lens)
cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.long)
def mk(*s): return torch.randn(*s, dtype=torch.float32)
q, k, v, g, beta = mk(1, T, H, K), mk(1, T, H, K), mk(1, T, HV, V), mk(1, T, HV, K), mk(1, T, HV)
A_log, dt = mk(HV) * 0.5, mk(HV * K) * 0.5
h0 = mk(len(lens), HV, V, K) * 0.5
ctx = fast_autotune(True); ctx.__enter__()
for lb in (None, -5.0):
    kw = dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              A_log=A_log, dt_bias=dt, lower_bound=lb, state_v_first=True, output_final_state=True)
    ins = [t.clone().requires_grad_(True) for t in (q, k, v, g, beta, h0)]
    o, s = torch_kda.chunk_kda(*ins[:5], initial_state=ins[5], cu_seqlens=cu, backend="native", **kw)
    (o.square().sum() + s.square().sum()).backward()
    gins = [t.detach().cuda().requires_grad_(True) for t in (q, k, v, g, beta, h0)]
    kwg = dict(kw, A_log=A_log.cuda(), dt_bias=dt.cuda())
    og, sg = torch_kda.chunk_kda(*gins[:5], initial_state=gins[5], cu_seqlens=cu.cuda(), backend="fla", safe_gate=lb is not None, **kwg)
    (og.square().sum() + sg.square().sum()).backward()
    rel = lambda a, b: ((a.detach().cpu().double() - b.detach().double()).norm() / b.detach().double().norm()).item()
    names = ["q", "k", "v", "g", "beta", "h0"]
    print(f"lower_bound={lb}: o {rel(og, o):.2e} state {rel(sg, s):.2e} " +
          " ".join(f"d{n} {rel(a.grad, b.grad):.2e}" for n, a, b in zip(names, gins, ins)))

"""bf16 inputs: the relative RMS error of the output and final state against float64, per kernel.

    python benchmarks/bf16_accuracy.py BACKEND...      # fla | chunk | recurrent
    TORCH_KDA_CHUNK_PRODUCTS=bf16 python benchmarks/bf16_accuracy.py chunk recurrent
    python benchmarks/bf16_accuracy.py --grads BACKEND...   # the gradients instead, T = 1K
    python benchmarks/bf16_accuracy.py --only "FLA init" --grads fla   # the cases named so
    python benchmarks/bf16_accuracy.py --sweep     # A_log's gradient over 40 seeds, per products

With ``--sweep``: a small problem (B 2, T 130, H 2, HV 4, K 32, V 48, V-first initial state, the
softplus gate in the op) over 40 seeds, with fp32 or bf16 products in the native chunk kernel's
forward and backward (TORCH_KDA_CHUNK_PRODUCTS set for each direction; the emulation where the CPU
has no AMX): the worst relative error of each gradient against float64 autograd of the reference
on the same bf16 inputs. ``A_log``'s gradient, sums with cancellation over all tokens and channels,
is the one that grows with bf16 products.

With ``--grads``: the relative RMS error of each input's gradient (random cotangents of the output
and the final state) against float64 autograd of the reference on the same bf16-rounded inputs,
at T = 1024 (the float64 oracle's autograd graph grows with T); FLA's bar is 0.008.

"fla": ``chunk_kda(backend="fla")`` on CUDA (FLA's chunk kernel, bf16 products); "chunk": the native
chunk kernel (its bf16 state products where TORCH_KDA_CHUNK_PRODUCTS and the CPU give them, an
emulation with the same numerics under ``=bf16`` on a CPU without AMX); "recurrent": the native
recurrent kernel (fp32 math). The float64 oracle is ``torch_kda.reference.fused_recurrent_kda`` on
the same bf16-rounded inputs (FLA's measure: the kernel's error, not the inputs' rounding). The
cases (H = 2, B = 1; same seeds on every machine) go from FLA's initialisation of the gate to very
slow decays with beta near 1 or 2 (allow_neg_eigval), where rounding the state to bf16 as a
product operand, in every chunk, adds up. docs/benchmarks.md, "Accuracy of the bf16 products".
"""
import math, os, sys, torch, torch_kda

ONLY = ""  # --only TEXT: the cases whose name holds TEXT


def cases():
    def gen(seed, T, K, g_scale, bshift, neg, fla_init):
        gen = torch.Generator().manual_seed(seed)
        r = lambda *s: torch.randn(*s, generator=gen)
        H = 2
        q, k, v = r(1, T, H, K), r(1, T, H, K), r(1, T, H, K)
        beta = r(1, T, H) + bshift
        kw = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                  allow_neg_eigval=neg, output_final_state=True)
        if fla_init:
            g = r(1, T, H, K)
            A_log = torch.empty(H).uniform_(1, 16, generator=gen).log()
            dt = torch.exp(torch.rand(H * K, generator=gen) * (math.log(0.1) - math.log(0.001)) + math.log(0.001))
            kw.update(A_log=A_log, dt_bias=dt + torch.log(-torch.expm1(-dt)), use_gate_in_kernel=True)
        else:
            g = -torch.rand(1, T, H, K, generator=gen) * g_scale
        return [x.bfloat16() for x in (q, k, v, g, beta)], kw
    for name, args in [  # (name, gen's arguments)
            ("K64 T2K g~U(-1e-3,0) beta=2sig(N+3) neg", (0, 2048, 64, 1e-3, 3, True, False)),
            ("K64 T2K g~U(-1e-3,0) beta=sig(N+3)", (0, 2048, 64, 1e-3, 3, False, False)),
            ("K128 T4K g~U(-1e-3,0) beta=sig(N+3)", (1, 4096, 128, 1e-3, 3, False, False)),
            ("K128 T4K g~U(-1e-3,0) beta=2sig(N+2) neg", (2, 4096, 128, 1e-3, 2, True, False)),
            ("K128 T4K FLA init gate, beta=sig(N)", (3, 4096, 128, 0, 0, False, True)),
            ("K128 T4K FLA init gate, beta=2sig(N) neg", (4, 4096, 128, 0, 0, True, True))]:
        if ONLY in name:
            yield name, gen(*args)

rel = lambda a, b: ((a.double().cpu() - b).norm() / b.norm()).item()


def run(b, args, kw):
    """(o, final state) of backend b on the bf16 inputs args and the keywords kw."""
    if b == "fla":
        return torch_kda.chunk_kda(*[x.cuda() for x in args], **{n: (x.cuda() if torch.is_tensor(x) else x) for n, x in kw.items()}, backend="fla")
    if b == "chunk":
        return torch_kda.chunk_kda(*args, **kw, backend="native")
    return torch_kda.fused_recurrent_kda(*args, **kw, backend="native")


def outputs():
    for name, (args, kw) in cases():
        dkw = {n: (x.double() if torch.is_tensor(x) else x) for n, x in kw.items()}
        ro, rs = torch_kda.reference.fused_recurrent_kda(*[x.double() for x in args], **dkw)
        line = f"{name:42s}"
        with torch.no_grad():
            for b in sys.argv[1:]:
                o, s = run(b, args, kw)
                line += f" | {b}: o {rel(o, ro):.2e} state {rel(s, rs):.2e}"
        print(line, flush=True)


def grads(backends):
    names = ["q", "k", "v", "g", "beta", "A_log", "dt_bias"]
    for name, (args, kw) in cases():
        args = [x[:, :1024] for x in args]
        gen = torch.Generator().manual_seed(7)
        leaves = dict(zip(names, args), **{n: kw[n] for n in ("A_log", "dt_bias") if n in kw})

        def grads_of(b, dtype):
            # (A_log and dt_bias stay fp32 beside bf16 inputs, as a model keeps them)
            param = torch.float64 if dtype == torch.float64 else torch.float32
            xs = {n: t.detach().to(dtype if n in names[:5] else param).requires_grad_()
                  for n, t in leaves.items()}
            call_kw = dict(kw, **{n: xs[n] for n in ("A_log", "dt_bias") if n in xs})
            if b == "reference":
                o, s = torch_kda.reference.fused_recurrent_kda(*[xs[n] for n in names[:5]], **call_kw)
            else:
                o, s = run(b, [xs[n] for n in names[:5]], call_kw)  # (fla: CUDA copies)
            d_o = torch.randn(o.shape, generator=torch.Generator().manual_seed(8)).to(o.dtype).to(o.device)
            d_s = torch.randn(s.shape, generator=torch.Generator().manual_seed(9)).to(s.dtype).to(s.device)
            torch.autograd.backward([o, s], [d_o, d_s])
            return {n: x.grad for n, x in xs.items()}

        ref = grads_of("reference", torch.float64)
        line = f"{name.replace('T2K', 'T1K').replace('T4K', 'T1K'):42s}"
        for b in backends:
            g = grads_of(b, torch.bfloat16)
            worst = max(names, key=lambda n: rel(g[n], ref[n]) if n in g else -1)
            line += f" | {b}: " + " ".join(f"{n} {rel(g[n], ref[n]):.1e}" for n in names if n in g)
            line += f" (worst {worst})"
        print(line, flush=True)


def sweep(seeds=range(100, 140)):
    knob = os.environ.get("TORCH_KDA_CHUNK_PRODUCTS")
    modes = [("fp32", "fp32"), ("bf16", "fp32"), ("bf16", "bf16")]  # forward / backward products
    names = ["q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias"]
    B, T, H, HV, K, V = 2, 130, 2, 4, 32, 48
    for fwd, bwd in modes:
        worst = {}
        for seed in seeds:
            gen = torch.Generator().manual_seed(seed)
            r = lambda *s, scale=1.0: torch.randn(*s, generator=gen, dtype=torch.float64) * scale
            q, k, v, g = r(B, T, H, K), r(B, T, H, K), r(B, T, HV, V), r(B, T, HV, K)
            dt_bias, A_log, beta, h0 = r(HV * K, scale=0.5), r(HV, scale=0.5), r(B, T, HV), r(B, HV, V, K, scale=0.5)
            leaves = dict(zip(names, (q, k, v, g, beta, h0, A_log, dt_bias)))
            # bf16 inputs; the state and the gate's parameters fp32, as a model keeps them
            side = ("initial_state", "A_log", "dt_bias")
            leaves = {n: (t.float() if n in side else t.bfloat16()).double() for n, t in leaves.items()}
            kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                      state_v_first=True, output_final_state=True)

            def grads_of(dtype, fn):
                xs = {n: t.to(torch.float32 if n in side and dtype != torch.float64 else dtype)
                      .requires_grad_() for n, t in leaves.items()}
                o, s = fn(*[xs[n] for n in names[:5]], initial_state=xs["initial_state"],
                          A_log=xs["A_log"], dt_bias=xs["dt_bias"], **kw)
                if dtype == torch.bfloat16:
                    os.environ["TORCH_KDA_CHUNK_PRODUCTS"] = bwd
                cg = torch.Generator().manual_seed(123)  # tests/test_chunk_products.py's cotangents
                d_o, d_s = (torch.randn(t.shape, generator=cg, dtype=torch.float64) for t in (o, s))
                loss = (o.double() * d_o).sum() + (s.double() * d_s).sum()
                return dict(zip(names, torch.autograd.grad(loss, [xs[n] for n in names])))

            ref = grads_of(torch.float64, torch_kda.reference.fused_recurrent_kda)
            os.environ["TORCH_KDA_CHUNK_PRODUCTS"] = fwd
            got = grads_of(torch.bfloat16, lambda *a, **k: torch_kda.chunk_kda(*a, **k, backend="native"))
            for n in names:
                e = rel(got[n], ref[n])
                worst[n] = max(worst.get(n, (0, 0)), (e, seed))
        others = max(e for n, (e, _) in worst.items() if n != "A_log")
        print(f"products forward {fwd} / backward {bwd}: worst of the other gradients {others:.1e}, "
              f"A_log {worst['A_log'][0]:.1e} (seed {worst['A_log'][1]})", flush=True)
    if knob is None:
        os.environ.pop("TORCH_KDA_CHUNK_PRODUCTS")
    else:
        os.environ["TORCH_KDA_CHUNK_PRODUCTS"] = knob


if sys.argv[1:2] == ["--only"]:  # FLA's autotuning takes minutes per case on a fresh machine
    ONLY = sys.argv[2]
    del sys.argv[1:3]
if sys.argv[1:2] == ["--sweep"]:
    sweep()
elif sys.argv[1:2] == ["--grads"]:
    grads(sys.argv[2:])
else:
    outputs()

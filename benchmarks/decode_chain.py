"""Decode as a serving loop runs it: each call's final state is the next call's initial state.

    python benchmarks/decode_chain.py B THREADS chain|same|pool
    TORCH_KDA_DECODE_STREAM=0 python benchmarks/decode_chain.py 8 1 chain   # plain stores forced
    TORCH_KDA_DECODE_STREAM=1 python benchmarks/decode_chain.py 8 1 chain   # non-temporal stores

One token per sequence, H = 32 heads, K = V = 128, fp32, `fused_recurrent_kda` with the state in
and out, K-first and V-first. "chain" feeds each call's final state to the next call (the state
then comes from wherever the last call's stores left it); "same" passes the same initial state
every call (as the peers benchmark does); "pool" updates every other slot of a pool of 2 B slots
in place (`ssm_state_indices`, `inplace_final_state=True`: the serving call). Prints the median
over 7 rounds of the microseconds per call (20 calls per round) for each layout
(docs/benchmarks.md, "Decode: the last-level cache from sysfs", "V-first decode from memory").
"""
import sys, time, torch, torch_kda

B, threads, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
torch.set_num_threads(threads)
H, K = 32, 128
g = torch.Generator().manual_seed(0)
q = torch.randn(B, 1, H, K, generator=g)
k = torch.nn.functional.normalize(torch.randn(B, 1, H, K, generator=g), dim=-1)
v = torch.randn(B, 1, H, K, generator=g)
gate = -torch.rand(B, 1, H, K, generator=g) * 0.1
beta = torch.rand(B, 1, H, generator=g)
s0 = torch.randn(B, H, K, K, generator=g) * 0.1
# The pool call: the B sequences packed as one batch row, one token each.
pool_args = [x.reshape(1, B, *x.shape[2:]) for x in (q, k, v, gate, beta)]
slots, cu = torch.arange(0, 2 * B, 2, dtype=torch.int32), torch.arange(B + 1)
times = {False: [], True: []}
with torch.inference_mode():
    for _ in range(7):
        for v_first in (False, True):
            s = s0.clone()
            pool = torch.randn(2 * B, H, K, K, generator=g) * 0.1
            t = time.perf_counter()
            for _ in range(20):
                if mode == "pool":
                    torch_kda.fused_recurrent_kda(*pool_args, initial_state=pool,
                                                  ssm_state_indices=slots, cu_seqlens=cu,
                                                  inplace_final_state=True, state_v_first=v_first)
                    continue
                _, s1 = torch_kda.fused_recurrent_kda(q, k, v, gate, beta, initial_state=s,
                                                      output_final_state=True,
                                                      state_v_first=v_first)
                if mode == "chain":
                    s = s1
            times[v_first].append((time.perf_counter() - t) / 20 * 1e6)
print(" ".join(f"{'V-first' if vf else 'K-first'} {sorted(ts)[3]:.0f} us" for vf, ts in times.items()))

"""Continuous batching and speculative decoding with one KDA state pool (docs/serving.md).

A tiny random one-layer KDA language model serves requests the way vLLM / SGLang-style engines do:

- every live request owns a slot of one state pool ``[num_slots, H, K, V]``;
- each engine step is ONE ``chunk_kda`` call over a packed mixed batch (``cu_seqlens``): the
  prompts of requests that just arrived (prefill) next to one token of every running request
  (decode); ``ssm_state_indices`` names each sequence's slot and ``inplace_final_state=True``
  writes the new states back into the pool;
- requests arrive and finish at different steps; a finished request's slot is reused;
- one request decodes speculatively: a toy drafter proposes tokens, ONE ``fused_recurrent_kda``
  call verifies them with 2-D ``ssm_state_indices`` (a snapshot slot per token), and the engine
  rolls back to the last accepted token through ``num_accepted_tokens`` on the next call.

At the end every request's tokens are checked against generating it alone, token by token.
Run: python examples/serving.py
"""

from __future__ import annotations

import torch

import torch_kda

VOCAB, D_MODEL, H, K, V = 61, 32, 2, 16, 16


class TinyKDALM(torch.nn.Module):
    """Embedding -> KDA (gate, norms and sigmoid in the op) -> logits; random weights."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(VOCAB, D_MODEL)
        self.qkv = torch.nn.Linear(D_MODEL, H * (2 * K + V) + H * K + H)
        self.A_log = torch.nn.Parameter(torch.rand(H))
        self.dt_bias = torch.nn.Parameter(torch.randn(H * K) * 0.5)
        self.head = torch.nn.Linear(H * V, VOCAB)

    def project(self, tokens: torch.Tensor):
        """tokens [T] -> q, k [1, T, H, K], v [1, T, H, V], g [1, T, H, K], beta [1, T, H]."""
        x = self.qkv(self.embed(tokens)).unsqueeze(0)
        q, k, v, g, beta = x.split([H * K, H * K, H * V, H * K, H], dim=-1)
        T = tokens.shape[0]
        return (q.view(1, T, H, K), k.view(1, T, H, K), v.view(1, T, H, V), g.view(1, T, H, K), beta)

    def kda_kwargs(self) -> dict:
        return dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                    use_beta_sigmoid_in_kernel=True, A_log=self.A_log, dt_bias=self.dt_bias)

    def logits(self, o: torch.Tensor) -> torch.Tensor:
        return self.head(o.reshape(o.shape[1], H * V))


@torch.inference_mode()
def generate_alone(model: TinyKDALM, prompt: list, n_new: int) -> list:
    """Greedy generation of one request with plain calls (state in, state out)."""
    tokens = list(prompt)
    state = torch.zeros(1, H, K, V)
    o, state = torch_kda.fused_recurrent_kda(*model.project(torch.tensor(tokens)), **model.kda_kwargs(),
                                             initial_state=state, output_final_state=True)
    nxt = int(model.logits(o)[-1].argmax())
    for _ in range(n_new - 1):
        tokens.append(nxt)
        o, state = torch_kda.fused_recurrent_kda(*model.project(torch.tensor([nxt])), **model.kda_kwargs(),
                                                 initial_state=state, output_final_state=True)
        nxt = int(model.logits(o)[-1].argmax())
    tokens.append(nxt)
    return tokens[len(prompt):]


class Engine:
    """One pool, mixed prefill/decode steps, slots recycled as requests finish."""

    def __init__(self, model: TinyKDALM, num_slots: int):
        self.model = model
        self.pool = torch.zeros(num_slots, H, K, V)
        self.free = list(range(num_slots))
        self.running = {}  # request id -> dict(slot, next token, generated, budget)

    @torch.inference_mode()
    def step(self, arrivals: dict) -> None:
        """One call: prompts of `arrivals` (id -> (prompt, n_new)) plus one token per running request."""
        seqs = []  # (request id, tokens fed this step)
        for rid, (prompt, n_new) in arrivals.items():
            slot = self.free.pop(0)
            self.pool[slot].zero_()  # a new request starts from the zero state
            self.running[rid] = dict(slot=slot, generated=[], budget=n_new)
            seqs.append((rid, prompt))
        for rid, r in self.running.items():
            if rid not in arrivals:
                seqs.append((rid, [r["next"]]))
        tokens = torch.tensor([t for _, toks in seqs for t in toks])
        lens = torch.tensor([len(toks) for _, toks in seqs])
        cu = torch.zeros(len(seqs) + 1, dtype=torch.long)
        cu[1:] = lens.cumsum(0)
        slots = torch.tensor([self.running[rid]["slot"] for rid, _ in seqs])
        o, _ = torch_kda.chunk_kda(*self.model.project(tokens), **self.model.kda_kwargs(),
                                   initial_state=self.pool, ssm_state_indices=slots,
                                   inplace_final_state=True, cu_seqlens=cu)
        last = self.model.logits(o)[cu[1:] - 1].argmax(-1)  # each sequence's next token
        for (rid, _), nxt in zip(seqs, last.tolist()):
            r = self.running[rid]
            r["generated"].append(nxt)
            r["next"] = nxt

    def finished(self) -> dict:
        done = {rid: r["generated"] for rid, r in self.running.items() if len(r["generated"]) >= r["budget"]}
        for rid in done:
            self.free.append(self.running.pop(rid)["slot"])  # the slot is reused later
        return done


@torch.inference_mode()
def speculative(model: TinyKDALM, prompt: list, n_new: int, drafts: int = 3) -> tuple:
    """Greedy generation with a toy drafter: verify `drafts` tokens per call, roll back on rejection.

    Pool slots 1..drafts+1 hold the snapshot after each token of a verify call; the next call
    starts from slot ``ssm_state_indices[0, num_accepted - 1]`` (the last accepted token's state).
    """
    pool = torch.zeros(drafts + 2, H, K, V)
    kw = model.kda_kwargs()
    # prefill the prompt except its last token into slot 1 (column 0 of the snapshot row)
    torch_kda.chunk_kda(*model.project(torch.tensor(prompt[:-1])), **kw, initial_state=pool,
                        ssm_state_indices=torch.tensor([1]), inplace_final_state=True)
    row = torch.arange(1, drafts + 2).unsqueeze(0)   # [1, drafts + 1] snapshot slots
    accepted_cols = torch.tensor([1])                # the state to resume from is in column 0
    cur, out, calls, accepted = prompt[-1], [], 0, 0

    seen = {}  # toy drafter: the token the model last produced after a given token

    def drafter(tok: int) -> list:
        guess = []
        for _ in range(drafts):
            tok = seen.get(tok, (tok + 1) % VOCAB)
            guess.append(tok)
        return guess

    while len(out) < n_new:
        guess = drafter(cur)
        feed = torch.tensor([cur] + guess)
        o, _ = torch_kda.fused_recurrent_kda(*model.project(feed), **kw, initial_state=pool,
                                             ssm_state_indices=row, num_accepted_tokens=accepted_cols,
                                             inplace_final_state=True)
        calls += 1
        pred = model.logits(o).argmax(-1).tolist()   # pred[j]: the model's token after feed[j]
        seen.update(zip(feed.tolist(), pred))
        a = 0
        while a < drafts and pred[a] == guess[a]:
            a += 1
        out += guess[:a] + [pred[a]]                 # accepted drafts + the model's own token
        accepted += a
        cur = pred[a]
        accepted_cols = torch.tensor([a + 1])        # rollback: resume after feed[a]
    return out[:n_new], calls, accepted


def main() -> None:
    model = TinyKDALM()
    gen = torch.Generator().manual_seed(1)
    requests = {rid: ([int(t) for t in torch.randint(0, VOCAB, (int(n),), generator=gen)], int(m))
                for rid, (n, m) in enumerate([(5, 6), (11, 3), (2, 8), (7, 4), (3, 5), (9, 2)])}
    queue = [(0, 0), (0, 1), (1, 2), (3, 3), (3, 4), (5, 5)]  # (arrival step, request id)
    engine = Engine(model, num_slots=3)
    results, step = {}, 0
    while len(results) < len(requests):
        # admit arrived requests while slots are free; the rest wait in the queue
        ready = [rid for at, rid in queue if at <= step][:len(engine.free)]
        queue = [(at, rid) for at, rid in queue if rid not in ready]
        engine.step({rid: requests[rid] for rid in ready})
        results.update(engine.finished())
        step += 1
    for rid, (prompt, n_new) in requests.items():
        alone = generate_alone(model, prompt, n_new)
        assert results[rid] == alone, (rid, results[rid], alone)
    print(f"continuous batching: {len(requests)} requests in {step} mixed steps over 3 pool slots; "
          "every request's tokens equal generating it alone")

    prompt, n_new = requests[2][0], 16
    spec, calls, accepted = speculative(model, prompt, n_new)
    alone = generate_alone(model, prompt, n_new)
    assert spec == alone, (spec, alone)
    print(f"speculative decoding: {n_new} tokens in {calls} verify calls (3 drafts each, "
          f"{accepted} drafts accepted), equal to greedy decoding alone")


if __name__ == "__main__":
    main()

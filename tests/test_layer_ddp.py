"""The KDA layer trains under DistributedDataParallel: 2 CPU processes, gloo backend.

Each rank trains on its own batch; DDP averages the gradients, so after each step every rank holds
the same weights, equal to those of one process stepping on the mean of both ranks' losses.
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kda_testing import rel_err

CFG = dict(hidden_size=16, head_dim=4, num_heads=2, num_v_heads=4, backend="reference", chunk_size=8)
STEPS, LR = 3, 0.1


def _batch(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(2, 11, CFG["hidden_size"], generator=g)


def _loss(layer, x: torch.Tensor) -> torch.Tensor:
    return layer(x).pow(2).mean()


def _worker(rank: int, world: int, init_file: str, result_dir: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from torch_kda.nn import KimiDeltaAttention

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)  # same initial weights on every rank
        layer = KimiDeltaAttention(**CFG)
        model = DDP(layer)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        for step in range(STEPS):
            opt.zero_grad()
            _loss(model, _batch(rank, step)).backward()
            opt.step()
        torch.save({k: v.detach().clone() for k, v in layer.state_dict().items()},
                   os.path.join(result_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
    # Done: leave without the interpreter's teardown. With torch 2.13's gloo a worker aborted
    # there about every other run ("terminate called without an active exception", SIGABRT after
    # destroy_process_group), a plain nn.Linear under DDP as often as this layer: torch's, not
    # ours. An exception above still propagates and fails the test.
    os._exit(0)


def test_layer_trains_under_ddp_gloo_two_processes():
    from torch_kda.nn import KimiDeltaAttention

    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.spawn(_worker, args=(2, init_file, tmp), nprocs=2, join=True)
        r0 = torch.load(os.path.join(tmp, "rank0.pt"))
        r1 = torch.load(os.path.join(tmp, "rank1.pt"))

    torch.manual_seed(0)
    single = KimiDeltaAttention(**CFG)
    initial = {k: v.clone() for k, v in single.state_dict().items()}
    opt = torch.optim.SGD(single.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        ((_loss(single, _batch(0, step)) + _loss(single, _batch(1, step))) / 2).backward()
        opt.step()
    for name, expected in single.state_dict().items():
        assert torch.equal(r0[name], r1[name]), name  # DDP keeps the replicas identical
        assert rel_err(r0[name] - initial[name], expected - initial[name]) < 1e-4, name

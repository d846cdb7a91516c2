"""The peer benchmark's own logic (torch_kda.peers), without the peers: they are built on demand by
benchmarks/peers/setup.sh, which the test suite does not run (a download and minutes of compiling)."""

from __future__ import annotations

import pytest
import torch

from torch_kda import peers
from torch_kda.__main__ import main
from torch_kda.benchmark import Shape

from oracle import oracle_kda


def test_bench_peers_without_a_build_exits_2_and_names_the_setup_script(tmp_path, capsys):
    try:
        code = main(["bench", "--peers", str(tmp_path), "--out", str(tmp_path / "out")])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2
    assert "setup.sh" in err and str(tmp_path) in err


def test_peer_inputs_reject_grouped_heads():
    with pytest.raises(ValueError, match="H == HV"):
        peers.peer_inputs(Shape(1, 4, 2, 4, 8, 8))


def test_both_state_layouts_of_ours_give_the_same_outputs_as_the_oracle():
    inp = peers.peer_inputs(Shape(2, 9, 2, 2, 16, 16), seed=3)
    o_k, s_k = peers.Ours(inp).outputs()
    o_v, s_v = peers.Ours(inp, state_v_first=True).outputs()
    assert torch.equal(o_k, o_v) and torch.equal(s_k, s_v)
    o_ref, s_ref = oracle_kda(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], initial_state=inp["h0"],
                              output_final_state=True)
    assert peers._rel_err(o_k, o_ref) < 1e-5
    assert peers._rel_err(s_k, s_ref) < 1e-5

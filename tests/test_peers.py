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
    assert not (tmp_path / "out").exists()  # nothing made before the check


def test_peer_inputs_reject_grouped_heads():
    with pytest.raises(ValueError, match="H == HV"):
        peers.peer_inputs(Shape(1, 4, 2, 4, 8, 8))


def test_both_state_layouts_of_ours_give_the_same_outputs_as_the_oracle():
    inp = peers.peer_inputs(Shape(2, 9, 2, 2, 16, 16), seed=3)
    o_k, s_k = peers.Ours(inp).outputs()
    o_v, s_v = peers.Ours(inp, state_v_first=True).outputs()
    o_ref, s_ref = oracle_kda(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], initial_state=inp["h0"],
                              output_final_state=True)
    # Equal to rounding, not bitwise: a call this small runs on the decode kernels, whose two
    # layouts sum their products in different orders.
    for o, s in ((o_k, s_k), (o_v, s_v)):
        assert peers._rel_err(o, o_ref) < 1e-5
        assert peers._rel_err(s, s_ref) < 1e-5


def test_peer_shapes_take_the_head_dim_in_prefill_and_decode():
    # --peers --head-dim 32 once ran K = V = 128 silently (the header said 32).
    shapes = peers.peer_shapes(seq_lens=[2, 64], heads=[1], head_dim=32, decode_batches=[3])
    assert [(s.T, s.H, s.K, s.V, s.decode) for s in shapes] == [
        (2, 1, 32, 32, False), (64, 1, 32, 32, False), (1, 32, 32, 32, True)]
    assert all(s.B == 1 for s in shapes[:2]) and shapes[2].B == 3
    assert peers.peer_shapes() == list(peers.PREFILL_SHAPES) + list(peers.DECODE_SHAPES)
    only_k = peers.peer_shapes(head_dim=64, decode=False)
    assert [(s.T, s.H, s.K) for s in only_k] == [(4096, 4, 64), (4096, 16, 64)]


def test_short_prefills_are_timed_as_several_calls_per_repetition():
    assert peers.calls_per_rep(Shape(1, 1, 32, 32, decode=True), 20) == 20
    assert peers.calls_per_rep(Shape(1, 2, 1, 1, 32, 32), 20) == 20
    assert peers.calls_per_rep(Shape(1, 64, 4, 4, 64, 64), 20) == 12  # 8.4 MFLOP: 12 hold 1e8
    assert peers.calls_per_rep(Shape(1, 4096, 4, 4), 20) == 1


def test_the_peer_table_names_a_head_dim_other_than_128():
    def timed(impl, T, K, seconds, decode=False):
        return dict(kind="time", impl=impl, B=1, T=T, H=2, K=K, V=K, decode=decode, threads=1,
                    seconds=seconds, sys_share=0.0, faults_per_call=0.0)
    results = [timed("ours", 8, 32, 1e-5), timed("ggml", 8, 32, 2e-5),
               timed("ours", 8, 128, 1e-4), timed("ggml", 8, 128, 1e-4),
               dict(kind="gemm", threads=1, gflops=100.0)]
    text = peers.format_peers(results)
    assert "| prefill B1 T8 H2 K32 V32, tokens/s | 1 | 800.0K | 400.0K | – | 2.00× |" in text
    assert "| prefill B1 T8 H2, tokens/s | 1 | 80.0K | 80.0K | – | 1.00× |" in text
    assert "| B1 T8 H2 K32 V32 | 1 |" in text
    agree = [dict(kind="agree", impl="ggml", B=1, T=8, H=2, K=32, V=32, decode=False, o_rel_err=1e-7,
                  state_rel_err=2e-7)]
    assert "| ggml B1 T8 H2 K32 V32 | 1.0e-07 | 2.0e-07 | ok |" in peers.format_peers(results + agree)

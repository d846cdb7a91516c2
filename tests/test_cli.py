"""The command line ``python -m torch_kda demo | bench | check``, run against the installed package.

The runs that matter to a user (``demo``, ``check``, ``bench``) are subprocesses
(``sys.executable -m torch_kda``), as a user runs them; argument errors and ``--help`` call
``torch_kda.__main__.main`` in-process (each subprocess pays the torch import). Sizes are tiny so
the module finishes in well under a minute on 2 cores.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import torch_kda
from torch_kda import benchmark
from torch_kda.__main__ import main

# A tiny model and few steps: seconds, not minutes.
TINY = ["--steps", "3", "--seq-len", "32", "--batch-size", "2", "--dim", "32", "--heads", "1",
        "--head-dim", "16", "--gen-len", "8", "--no-progress"]


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", MPLBACKEND="Agg")
    return subprocess.run([sys.executable, "-m", "torch_kda", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def call_main(args, capsys):
    """``main(args)`` in-process: (exit status, stdout, stderr); argparse's SystemExit included."""
    try:
        code = main(list(args))
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def python_text(tmp_path_factory) -> Path:
    """A real text file (this package's own sources concatenated), large enough to train on."""
    root = Path(torch_kda.__file__).parent
    data = b"".join(p.read_bytes() for p in sorted(root.rglob("*.py")))
    path = tmp_path_factory.mktemp("text") / "corpus.txt"
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("command", ["demo", "bench", "check"])
def test_each_subcommand_has_help(command, capsys):
    code, out, _ = call_main([command, "--help"], capsys)
    assert code == 0
    assert "usage:" in out and command in out


@pytest.mark.parametrize("args, message", [
    (["demo", "--steps", "0"], "--steps: expected a positive integer, got 0"),
    (["demo", "--seq-len", "-5"], "--seq-len: expected a positive integer, got -5"),
    (["demo", "--batch-size", "two"], "--batch-size: expected a positive integer, got 'two'"),
    (["demo", "--lr", "0"], "--lr: expected a positive number"),
    (["--steps", "5"], "expected a command (demo, bench, check, hf) before the options, got --steps 5"),
    (["demo", "--backend", "cuda"], "invalid choice"),
    (["bench", "--seq-lens", "0"], "expected a positive integer"),
    (["check", "--tol", "-1"], "--tol: expected a positive number"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_arguments_exit_2_with_message(args, message, capsys):
    code, _, err = call_main(args, capsys)
    assert code == 2
    assert message in err


def test_no_arguments_print_the_usage_and_exit_2(capsys):
    code, out, err = call_main([], capsys)
    assert code == 2
    assert "usage:" in err and "{demo,bench,check,hf}" in err and out == ""


def _no_work(*args, **kwargs):
    raise AssertionError("the demo started its work before checking --out")


def test_demo_out_an_existing_file_exits_2_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("torch_kda.cli.demo.load_corpus", _no_work)
    existing = tmp_path / "results.txt"
    existing.write_text("keep me")
    code, _, err = call_main(["demo", "--out", str(existing)], capsys)  # default sizes: minutes if it ran
    assert code == 2
    assert f"--out: expected a folder, got an existing file: {existing}" in err
    assert existing.read_text() == "keep me"


def test_demo_out_that_cannot_be_created_exits_2_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("torch_kda.cli.demo.load_corpus", _no_work)
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    code, _, err = call_main(["demo", "--out", str(a_file / "sub")], capsys)
    assert code == 2
    assert f"--out: cannot create or write into the folder {a_file / 'sub'}" in err


def test_bench_out_an_existing_file_exits_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("torch_kda.benchmark.bench", _no_work)
    existing = tmp_path / "bench.md"
    existing.write_text("")
    code, _, err = call_main(["bench", "--quick", "--out", str(existing)], capsys)
    assert code == 2
    assert "--out: expected a folder, got an existing file" in err


@pytest.mark.parametrize("command, module", [("demo", "tqdm"), ("demo", "matplotlib"), ("bench", "matplotlib")])
def test_a_missing_cli_extra_names_the_install_command(command, module, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, module, None)  # what an install without the `cli` extra looks like
    monkeypatch.setattr("torch_kda.cli.demo.load_corpus", _no_work)
    monkeypatch.setattr("torch_kda.benchmark.bench", _no_work)
    code, _, err = call_main([command, "--out", str(tmp_path)], capsys)
    assert code == 1
    assert module in err and 'pip install "torch-kda[cli]"' in err


@pytest.mark.parametrize("argv, message", [
    # --decode-batches ran nothing without --peers while bench.md printed it
    (["--decode-batches", "4"],
     "--decode-batches does not apply to the default benchmark (it applies to --peers)"),
    (["--chunk", "--backends", "native"], "--backends does not apply to --chunk"),
    (["--chunk", "--no-decode"], "--no-decode does not apply to --chunk"),
    (["--chunk", "--decode-batches", "2"], "--decode-batches does not apply to --chunk"),
    (["--peers", "DIR", "--quick"],
     "--quick does not apply to --peers (it applies to --chunk and the default benchmark)"),
    (["--peers", "DIR", "--backends", "reference"], "--backends does not apply to --peers"),
    (["--peers", "DIR", "--chunk"], "--peers and --chunk are two different benchmarks"),
])
def test_bench_options_a_mode_does_not_read_exit_2(argv, message, tmp_path, capsys, monkeypatch):
    for name in ("torch_kda.benchmark.bench", "torch_kda.benchmark.chunk_rows",
                 "torch_kda.peers.bench_peers"):
        monkeypatch.setattr(name, _no_work)
    code, _, err = call_main(["bench", *argv, "--out", str(tmp_path / "out")], capsys)
    assert code == 2
    assert message in err
    assert not (tmp_path / "out").exists()


def test_bench_decode_shapes_take_the_head_dim():
    # The default benchmark's decoding rows once stayed K = V = 128 whatever --head-dim said.
    shapes = benchmark.settings(head_dim=16, seq_lens=[64])["shapes"]
    assert {(s.K, s.V) for s in shapes} == {(16, 16)}
    assert [(s.B, s.H) for s in shapes if s.decode] == [(1, 32), (8, 32)]


def test_bench_summary_speaks_of_ratios_not_of_targets():
    from torch_kda import benchmark

    rows = [dict(name="forward speed-up vs reference", threads=1, value=3.0 + torch_rand(), target=30.0,
                 higher=True, unit="×", passed=False),
            dict(name="forward % of GEMM rate", threads=1, value=10.0 + torch_rand(), target=50.0,
                 higher=True, unit="%", passed=False),
            dict(name="forward: 2 threads vs 1", threads=2, value=None, target=1.7, higher=True, unit="×",
                 passed=None)]
    text = benchmark.format_targets(rows, verdicts=False)
    assert "GEMM rate" in text and f"{rows[0]['value']:.1f}×" in text
    for word in ("issue", "target", "FAIL", "PASS", "required", "not measured"):
        assert word not in text
    info = dict(cpu="cpu", logical_cpus=2, torch="2", commit=None, load_avg=(0.5, 0.5, 0.5))
    assert "commit" not in benchmark.report([], info, "torch-kda bench", 1.0, verdicts=False)


def torch_rand() -> float:
    import torch

    return float(torch.rand(()))


def test_bad_argument_in_a_subprocess_exits_2_without_traceback():
    res = run_cli("demo", "--steps", "-1")
    assert res.returncode == 2
    assert "--steps: expected a positive integer, got -1" in res.stderr
    assert "Traceback" not in res.stderr


def test_missing_text_file_exits_2(tmp_path, capsys):
    code, _, err = call_main(["demo", "--text", str(tmp_path / "nope.txt"), *TINY], capsys)
    assert code == 2
    assert "--text: file not found" in err and "nope.txt" in err


def test_empty_text_file_exits_2(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    code, _, err = call_main(["demo", "--text", str(empty), *TINY], capsys)
    assert code == 2
    assert "--text: the file is empty" in err


def test_directory_as_text_exits_2(tmp_path, capsys):
    code, _, err = call_main(["demo", "--text", str(tmp_path), *TINY], capsys)
    assert code == 2
    assert "--text: not a regular file" in err


def test_native_backend_without_a_build_exits_2(capsys, monkeypatch):
    # Simulate an install without the native library (what _native._load reports then).
    monkeypatch.setattr(torch_kda._native, "LOAD_ERROR", "the native library was not built (simulated)")
    code, _, err = call_main(["demo", "--backend", "native", *TINY], capsys)
    assert code == 2
    assert "--backend native: the native backend is unavailable" in err


def test_in_process_demo_restores_the_thread_count(tmp_path, capsys):
    import torch

    before = torch.get_num_threads()
    code, out, _ = call_main(["demo", *TINY, "--threads", "1", "--out", str(tmp_path)], capsys)
    assert code == 0, out
    assert torch.get_num_threads() == before


def test_seq_len_longer_than_text_exits_2(python_text, capsys):
    code, _, err = call_main(["demo", "--text", str(python_text), *TINY, "--seq-len", "100000000"], capsys)
    assert code == 2
    assert "--seq-len: expected at most" in err


def test_tiny_demo_trains_checks_decoding_and_writes_the_plot(tmp_path):
    out = tmp_path / "out"
    res = run_cli("demo", *TINY, "--out", str(out), cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    text = res.stdout
    assert "unigram (byte-frequency) entropy" in text
    assert "Python standard library" in text
    assert "held-out loss" in text
    assert "cached decoding vs full forward" in text and "PASS" in text
    if torch_kda.available_backends()["native"].available:
        assert "gradient check (step 1, on its batch): native vs reference" in text
    else:
        assert "native backend is unavailable" in text
    png = out / "demo_loss.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(png.resolve()) in text
    metrics = json.loads((out / "demo_metrics.json").read_text())
    assert len(metrics["train_losses"]) == 3
    assert metrics["cache_max_rel_diff"] < 1e-4
    assert 0 < metrics["unigram_entropy"] < 8


def test_demo_reads_text(tmp_path, python_text, capsys):
    code, out, _ = call_main(["demo", *TINY, "--text", str(python_text), "--out", str(tmp_path), "--seed", "3"], capsys)
    assert code == 0, out
    assert str(python_text) in out
    assert "seed 3" in out
    assert (tmp_path / "demo_loss.png").is_file()


def test_check_passes_and_prints_the_table():
    res = run_cli("check")
    assert res.returncode == 0, res.stdout + res.stderr
    for needle in ("case", "backend", "fwd err", "grad err", "GVA", "varlen", "bounded gate",
                   "state_v_first", "reference (chunk)", "PASS"):
        assert needle in res.stdout
    assert "FAIL" not in res.stdout
    if torch_kda.available_backends()["native"].available:
        assert "native (chunk_kda)" in res.stdout


def test_check_fails_with_an_impossible_tolerance(capsys):
    code, out, _ = call_main(["check", "--tol", "1e-30"], capsys)
    assert code == 1
    assert "FAIL" in out


def test_bench_prints_every_backend_and_writes_the_plot(tmp_path):
    # The same engine as benchmarks/bench_cpu.py (torch_kda.benchmark) on a tiny grid: seconds.
    out = tmp_path / "out"
    res = run_cli("bench", "--quick", "--seq-lens", "16", "32", "--heads", "1", "--head-dim", "8",
                  "--threads", "1", "--reps", "2", "--no-decode", "--out", str(out), cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    text = res.stdout
    expected = ["reference", "compiled"]
    if torch_kda.available_backends()["native"].available:
        expected.append("native")
        assert "native % GEMM" in text and "× reference" in text
    if importlib.util.find_spec("fla") is not None:
        expected.append("fla_naive")
    for mode in ("**forward, fp32**", "**forward + backward, fp32**"):
        assert mode in text
    header = next(line for line in text.splitlines() if line.startswith("| shape | thr |"))
    for backend in expected:
        assert f"{backend} tok/s" in header
    assert "B1 T16 H1 K8 V8" in text and "B1 T32 H1 K8 V8" in text and "–[^" not in text
    assert "GFLOP/s" in text
    png = out / "bench_tokens_per_s.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(png.resolve()) in text
    results = json.loads((out / "bench.json").read_text())["results"]
    assert {r["backend"] for r in results if r["kind"] == "time"} == set(expected)
    assert (out / "bench.md").read_text().strip() in text


@pytest.mark.parametrize("main_name", ["chunk_main", "overhead_main"])
def test_benchmark_json_path_is_checked_before_the_measurements(tmp_path, capsys, monkeypatch, main_name):
    """``python -m torch_kda.benchmark chunk|overhead --json PATH``: a folder, or a file in a
    folder that does not exist, stops the command at parsing (exit status 2), before minutes of
    measurements that could then not be written."""
    from torch_kda import benchmark

    def no_work(*args, **kwargs):
        raise AssertionError("measured before checking --json")

    monkeypatch.setattr(benchmark, "overhead_rows", no_work)
    monkeypatch.setattr(benchmark, "machine_info", no_work)
    for bad, message in ((tmp_path, "expected a file path, got the folder"),
                         (tmp_path / "missing" / "r.json", "does not exist")):
        with pytest.raises(SystemExit) as exc:
            getattr(benchmark, main_name)(["--json", str(bad)])
        assert exc.value.code == 2
        assert message in capsys.readouterr().err


def test_bench_chunk_takes_the_head_dim(tmp_path, capsys):
    # --chunk once ignored --head-dim and ran K = V = 128.
    code, out, err = call_main(["bench", "--chunk", "--seq-lens", "64", "--heads", "1", "--head-dim", "16",
                                "--threads", "1", "--reps", "1", "--out", str(tmp_path / "out")], capsys)
    if not torch_kda.available_backends()["native"].available:
        assert code == 2 and "--chunk" in err
        return
    assert code == 0, err
    rows = json.loads((tmp_path / "out" / "chunk.json").read_text())["rows"]
    assert {r["shape"] for r in rows} == {"B1 T64 H1 K16 V16"}
    assert "| fp32 | B1 T64 H1 K16 V16 | 1 | fwd |" in out


def test_demo_head_dim_1_is_a_usage_error(capsys):
    # --head-dim 1 once trained, then printed "A CHECK FAILED" (exit 1) with a correct library: at
    # K = 1 the q/k L2 norm is a sign function, and its slope fails the fp32 comparisons.
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--head-dim", "1"])
    assert exc.value.code == 2
    assert "expected an integer >= 2 (at 1 the q/k L2 norm is a sign function" in capsys.readouterr().err


def test_more_threads_than_cpus_gets_a_note():
    from torch_kda.cli.common import oversubscribed_threads
    cpus = len(os.sched_getaffinity(0))
    assert oversubscribed_threads(cpus) == ""
    assert f"--threads {cpus + 1} is more than the {cpus} CPU(s)" in oversubscribed_threads(cpus + 1)

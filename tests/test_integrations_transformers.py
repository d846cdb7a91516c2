"""Hugging Face transformers' Kimi-Linear with its KDA run by torch-kda (integrations.transformers).

A tiny random ``KimiLinearForCausalLM`` (built from a config, no network) is compared with itself
on transformers' own pure-PyTorch KDA path: prefill logits, greedy generation with the cache, a
training step's gradients, a left-padded batch, a save/reload round trip. ``make test`` installs
FLA + Triton, so transformers has bound FLA's Triton kernels here; the routes must not reach them.
"""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

from kda_testing import rel_err
from torch_kda.integrations.transformers import kda_layers, use_torch_kda

from transformers import KimiLinearConfig, KimiLinearForCausalLM  # noqa: E402

VOCAB = 97


def tiny_model(seed: int = 0, layers=("linear_attention", "full_attention", "linear_attention")):
    cfg = KimiLinearConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=len(layers), num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, num_experts=4, num_experts_per_token=2,
        linear_num_heads=2, linear_head_dim=16, layer_types=list(layers), initializer_range=0.2,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    return KimiLinearForCausalLM(cfg).eval()


def pair(seed: int = 0):
    """(transformers' own pure-PyTorch KDA, torch-kda) on identical weights."""
    model = tiny_model(seed)
    return use_torch_kda(copy.deepcopy(model), "transformers"), use_torch_kda(model)


def ids(shape, seed):
    return torch.randint(3, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def test_prefill_logits_match_transformers_own_path():
    ref, fast = pair(1)
    x = ids((2, 300), 11)
    with torch.no_grad():
        expected, got = ref(x).logits, fast(x).logits
    assert rel_err(got, expected) < 1e-5


def test_greedy_generation_with_cache_is_token_identical():
    ref, fast = pair(2)
    prompt = ids((1, 24), 12)
    expected = ref.generate(prompt, max_new_tokens=32, do_sample=False, min_new_tokens=32)
    got = fast.generate(prompt, max_new_tokens=32, do_sample=False, min_new_tokens=32)
    assert got.shape == (1, 56) and torch.equal(got, expected)
    assert len(set(got[0, 24:].tolist())) > 4  # a real continuation, not one repeated token


def test_training_step_gradients_match_transformers_own_path():
    ref, fast = pair(3)
    ref.train()
    fast.train()
    x = ids((2, 150), 13)
    grads = []
    for model in (ref, fast):
        model.zero_grad()
        model(x, labels=x).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    expected, got = grads
    assert set(got) == set(expected)
    kda_names = [n for n in got if ".self_attn." in n and ("A_log" in n or "q_proj" in n or "dt_bias" in n)]
    assert kda_names  # the KDA layers' own parameters are among them
    for name in expected:
        assert rel_err(got[name], expected[name]) < 1e-5, name


def test_left_padded_batch_matches_transformers_own_path_and_unpadded_rows():
    ref, fast = pair(4)
    x = ids((2, 40), 14)
    mask = torch.ones_like(x)
    mask[1, :13] = 0  # row 1: 13 pad tokens on the left
    x[1, :13] = 0
    with torch.no_grad():
        expected = ref(x, attention_mask=mask).logits
        got = fast(x, attention_mask=mask).logits
        alone = fast(x[1:, 13:]).logits
    assert rel_err(got, expected) < 1e-5
    assert rel_err(got[1:, 13:], alone) < 1e-5


def test_save_and_reload_from_a_local_folder(tmp_path):
    model = tiny_model(5)
    model.save_pretrained(tmp_path)
    reloaded = use_torch_kda(KimiLinearForCausalLM.from_pretrained(tmp_path).eval())
    ref = use_torch_kda(model, "transformers")
    x = ids((1, 70), 15)
    with torch.no_grad():
        assert rel_err(reloaded(x).logits, ref(x).logits) < 1e-5


def test_routing_is_per_model_and_errors_name_the_argument(monkeypatch):
    plain = tiny_model(6)
    use_torch_kda(tiny_model(6))
    # A model that was not routed still calls whatever transformers bound (here FLA's Triton
    # kernels, which fail on CPU): the routers installed for another model do not touch it.
    # (FLA_TORCH_KDA=0: torch-kda's FLA backend, if another test registered it, stays out.)
    monkeypatch.setenv("FLA_TORCH_KDA", "0")
    with pytest.raises(RuntimeError, match="active drivers"):
        with torch.no_grad():
            plain(ids((1, 8), 16))
    assert len(kda_layers(plain)) == 2
    with pytest.raises(ValueError, match="implementation"):
        use_torch_kda(plain, "fla")
    with pytest.raises(ValueError, match="KimiLinearDeltaAttention"):
        use_torch_kda(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="model"):
        use_torch_kda("model")


def test_importing_torch_kda_and_its_integrations_imports_no_third_party_library_nor_dynamo():
    code = ("import sys, torch_kda, torch_kda.integrations, torch_kda.integrations.fla, "
            "torch_kda.integrations.transformers\n"
            "bad = [m for m in ('fla', 'transformers', 'kernels', 'triton', 'torch._dynamo')\n"
            "       if m in sys.modules]\n"
            "assert not bad, bad\nprint('ok')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


def test_kda_clock_times_the_routed_calls_forward_and_backward():
    from torch_kda.integrations.transformers import kda_clock

    model = use_torch_kda(tiny_model(7)).train()
    x = ids((1, 64), 17)
    with kda_clock() as clock:
        model(x, labels=x).loss.backward()
    assert clock[0] > 0 and clock[1] > 0
    with kda_clock() as clock:  # a model that is not routed is not counted
        with torch.no_grad():
            use_torch_kda(model, "transformers")(x)
    assert clock[0] > 0


def test_hf_command_compares_both_paths_saves_and_reloads(tmp_path, capsys):
    from torch_kda.__main__ import main

    tiny = ["--hidden-size", "64", "--layers", "2", "--kda-heads", "2", "--head-dim", "16", "--vocab-size", "128",
            "--prompt-len", "70", "--new-tokens", "6", "--reps", "1", "--threads", "1"]
    assert main(["hf", *tiny, "--save", str(tmp_path / "m")]) == 0
    out = capsys.readouterr().out
    assert "greedy tokens identical: 6/6" in out and "prefill tok/s" in out and "decode ms/tok" in out
    assert main(["hf", *tiny, "--model", str(tmp_path / "m")]) == 0
    assert "greedy tokens identical: 6/6" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["hf", "--model", str(tmp_path / "missing")])
    assert exc.value.code == 2
    # a model without a KDA layer (saved from transformers itself) is a usage error too
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    KimiLinearForCausalLM(KimiLinearConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=1,
        num_key_value_heads=1, kv_lora_rank=16, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
        linear_num_heads=2, linear_head_dim=16, layer_types=["full_attention"],
        mlp_layer_types=["dense"], pad_token_id=0, bos_token_id=1, eos_token_id=2)).save_pretrained(tmp_path / "mla_only")
    with pytest.raises(SystemExit) as exc:
        main(["hf", "--model", str(tmp_path / "mla_only")])
    assert exc.value.code == 2
    assert "no KDA (linear_attention) layer" in capsys.readouterr().err
    # --bench: the same measurements plus a training step and the KDA calls' time inside the model
    assert main(["hf", "--bench", *tiny]) == 0
    out = capsys.readouterr().out
    assert "| prefill (s)" in out and "| decode (ms/token)" in out and "| train (s)" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--layers", "1"], "--layers: expected an integer >= 2 (one KDA layer besides the full-attention one), got 1"),
        (["--vocab-size", "3"], "--vocab-size: expected an integer >= 4 (ids 0-2 are the special tokens), got 3"),
        (["--save", "{file}"], "--save: expected a folder, got an existing file"),
    ],
)
def test_hf_command_refuses_bad_sizes_and_a_save_path_that_is_a_file_before_any_work(
        tmp_path, capsys, args, message):
    """Exit status 2 with a usage message, never a traceback (status 1 means "the paths
    disagree") nor a "saved" for a save that did not happen."""
    from torch_kda.__main__ import main

    file = tmp_path / "afile"
    file.write_bytes(b"")
    args = [a.format(file=file) for a in args]
    with pytest.raises(SystemExit) as exc:
        main(["hf", "--hidden-size", "64", "--kda-heads", "2", "--head-dim", "16", "--vocab-size", "128",
              "--prompt-len", "8", "--new-tokens", "2", "--reps", "1", *args])
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert message in err and "saved" not in out
    assert file.read_bytes() == b""

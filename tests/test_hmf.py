"""hybrid-model-factory (hmf) -> kvfree: small random `hybrid_qwen3` models (attention, SWA, GKA, Gated DeltaNet,
Mamba-2 and B'MOJO-F layers) made and run by hmf's own code on a GPU (tests/fixtures/hmf/make_fixtures.py) are
converted with `kvfree convert --from hmf`; kvfree must give hmf's logits (fp32 fixtures: relative error <= 1e-4;
bf16: <= 2e-2, or hmf's own bf16 error where it is larger) through its training forward and through its serving path
(a prefill in two pieces, then one decode step per token, on a state pool), and the same greedy tokens. Malformed
configs are refused naming the key."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kvfree.checkpoints import CheckpointError
from kvfree.checkpoints.byte_tokenizer import write_byte_tokenizer
from kvfree.checkpoints.hf_hmf import convert_hmf
from kvfree.engine.model.loader import load_model
from kvfree.engine.model.step_batch import StepBatch
from kvfree.engine.state.pool import StatePool
from tests.conftest import rel_err

FIXTURES = Path(__file__).parent / "fixtures" / "hmf"
SERVED = ["gka_fp32", "gka_bf16", "gka_lowrank_fp32", "m2_fp32", "m2_bf16", "bmf_bf16", "bmf_m2_bf16", "swa_fp32",
          "gdn_fp32", "gka_fp32_long", "gka_bf16_long", "gdn_fp32_long"]  # fmt: skip
# The *_long fixtures: 150-token prompts (three 64-token chunks of hmf's chunked prefill), made with the fla hmf pins
# (0.4.1; report_long.json): kvfree held to hmf's chunked path past its chunk boundaries (docs/design/hmf.md).
TOLERANCE = {"fp32": 1e-4, "bf16": 2e-2}
# hmf's B'MOJO-F runs in bf16 only (it casts inside), so there is no fp32 run to hold its bf16 fixtures to; with GKA
# as the fading layer, hmf's bf16 GKA is itself 4.9% from its fp32 run (the gka fixtures), which bounds this one.
# GDN's fp32 layer is well conditioned (no solve): held tighter than the default, to what it gives (5.5e-7 through the
# training forward on the CPU).
FIXTURE_TOLERANCE = {"bmf_bf16": 5e-2, "gdn_fp32": 1e-5, "gdn_fp32_long": 1e-5}
# CI runs the PyTorch reference on the CPU; on a GPU machine the same fixtures also go through the Triton kernels.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tok")
    write_byte_tokenizer(path)
    return path


def converted(name: str, tmp_path: Path, tokenizer: Path, device: str):
    """(kvfree model in the fixture's dtype, hmf's expected outputs, tolerance) for fixture `name`."""
    dst = convert_hmf(FIXTURES / name, tmp_path / name, tokenizer_from=tokenizer)
    model = load_model(dst, device=device, dtype="float32" if precision(name) == "fp32" else "bfloat16")
    tol = FIXTURE_TOLERANCE.get(name, TOLERANCE[precision(name)])
    return model, load_file(str(FIXTURES / name / "expected.safetensors")), tol


def precision(name: str) -> str:
    """The fixture's dtype, "fp32" or "bf16", from its name (`gka_bf16`, `gdn_fp32_long`)."""
    return next(part for part in name.split("_") if part in TOLERANCE)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", SERVED)
def test_converted_hmf_model_matches_hmf(name, device, tmp_path, byte_tokenizer):
    model, want, tol = converted(name, tmp_path, byte_tokenizer, device)
    prompt, greedy = want["input_ids"].tolist(), want["greedy"].tolist()
    ids = prompt + greedy
    logits = want["logits"].to(device)

    if precision(name) == "bf16" and (FIXTURES / name.replace("bf16", "fp32")).is_dir():
        # hmf's own bf16 run is the reference only up to its rounding: its Chebyshev solve runs its dots in bf16
        # (kvfree's in fp32). So bf16 is held to hmf's fp32 run of the same weights: kvfree in bf16 must be as
        # close to it as hmf's own bf16 run is (or within the tolerance).
        logits = load_file(str(FIXTURES / name.replace("bf16", "fp32") / "expected.safetensors"))["logits"].to(device)
        tol = max(tol, rel_err(want["logits"].to(device), logits))
    with torch.no_grad():
        assert rel_err(model(torch.tensor([ids], device=device))[0], logits) <= tol  # the training forward

    pool = StatePool(model, capacity=3, max_context=max(128, len(ids) + 1))
    cut = 23  # a prefill in two pieces: the second continues from the state the first left

    def run(tokens: list[int], batch: StepBatch, **kw) -> torch.Tensor:
        return model.prefill(torch.tensor(tokens, device=device), pool.tensors, batch, **kw)

    with torch.inference_mode():
        rows = [
            run(prompt[:cut], StepBatch.prefill([1], [cut], device), all_logits=True),
            run(prompt[cut:], StepBatch.prefill([1], [len(prompt) - cut], device), all_logits=True),
        ]
        tokens = []
        for t in range(len(prompt), len(ids)):  # decode: the greedy token, then hmf's next token teacher-forced
            tokens.append(int(rows[-1][-1].argmax()))
            ids_t = torch.tensor([ids[t]], device=device)
            rows.append(model.decode(ids_t, pool.tensors, StepBatch.decode([1], device)))
    assert rel_err(torch.cat(rows), logits) <= tol
    if precision(name) == "fp32":
        assert tokens == greedy
    else:  # bf16 rounding may flip a near-tie: each token must be hmf's choice or within rounding of it
        hmf_rows = want["logits"][len(prompt) - 1 : -1].to(device)
        chosen = hmf_rows.gather(1, torch.tensor(tokens, device=device)[:, None])[:, 0]
        spread = hmf_rows.max(-1).values - hmf_rows.min(-1).values
        assert bool((hmf_rows.max(-1).values - chosen <= tol * spread).all()), (tokens, greedy)
        assert sum(a == b for a, b in zip(tokens, greedy, strict=True)) >= len(greedy) - 1


def _edited(tmp_path: Path, name: str, edit) -> Path:
    """A copy of fixture `name` whose config.json went through `edit(config)`."""
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / name, src)
    config = json.loads((src / "config.json").read_text())
    edit(config)
    (src / "config.json").write_text(json.dumps(config))
    return src


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c.update(hybrid_override_pattern="*-GKA*-*"), r"layer 1 is 'GKA\*', a training-stage layer"),
        (lambda c: c.update(hybrid_override_pattern="*-XYZ-*"), "layer 1 has unknown layer type 'XYZ'"),
        (lambda c: c.update(hybrid_override_pattern="*-GKA"), "has 2 layers, num_hidden_layers is 3"),
        (lambda c: c["gka_config"].update(mystery=1), "unknown gka_config key 'mystery'"),
        (lambda c: c["gka_config"].update(solver_type="cg"), "solver_type is 'cg'"),
        (lambda c: c["gka_config"].update(num_iter=-1), "num_iter must be an integer >= 0"),
        (lambda c: c.update(model_type="qwen3"), "expected 'hybrid_qwen3'"),
    ],
)
def test_bad_configs_are_refused_naming_the_key(edit, message, tmp_path, byte_tokenizer):
    src = _edited(tmp_path, "gka_fp32", edit)
    with pytest.raises(CheckpointError, match=message):
        convert_hmf(src, tmp_path / "out", tokenizer_from=byte_tokenizer)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c["gdn_config"].update(use_short_conv=False), "use_short_conv = false"),
        (lambda c: c["gdn_config"].update(conv_bias=True), "conv_bias = true"),
        (lambda c: c["gdn_config"].update(head_dim=64), "gdn_config.head_dim is 64 but the model's shape implies 32"),
        (lambda c: c["gdn_config"].update(mode="chunk"), "unknown gdn_config key 'mode'"),
    ],
)
def test_gdn_configs_kvfree_cannot_serve_are_refused_naming_the_key(edit, message, tmp_path, byte_tokenizer):
    src = _edited(tmp_path, "gdn_fp32", edit)
    with pytest.raises(CheckpointError, match=message):
        convert_hmf(src, tmp_path / "out", tokenizer_from=byte_tokenizer)


@pytest.mark.parametrize(
    ("name", "edit", "message"),
    [
        ("m2_fp32", lambda c: c["mamba2_config"].update(use_pos_emb=True), "use_pos_emb = true"),
        ("m2_fp32", lambda c: c["mamba2_config"].update(d_state=7), "unknown mamba2_config key 'd_state'"),
        ("bmf_bf16", lambda c: c["bmojo_config"].update(ssm_mixer="gdn"), "ssm_mixer 'gdn' is not supported"),
        ("bmf_bf16", lambda c: c["bmojo_config"].update(stride=2), "unknown bmojo_config key 'stride'"),
    ],
)
def test_bad_mamba2_and_bmojo_configs_are_refused(name, edit, message, tmp_path, byte_tokenizer):
    src = _edited(tmp_path, name, edit)
    with pytest.raises(CheckpointError, match=message):
        convert_hmf(src, tmp_path / "out", tokenizer_from=byte_tokenizer)


def test_missing_and_misshapen_tensors_are_refused(tmp_path, byte_tokenizer):
    src = _edited(tmp_path, "gka_fp32", lambda c: c["gka_config"].update(use_v_conv=False))
    with pytest.raises(CheckpointError, match=r"unexpected HF tensor 'model\.layers\.1\.gka\.v_conv1d\.weight'"):
        convert_hmf(src, tmp_path / "out", tokenizer_from=byte_tokenizer)
    src2 = _edited(tmp_path / "b", "gka_fp32", lambda c: c.update(num_key_value_heads=4))
    with pytest.raises(CheckpointError, match="has shape"):
        convert_hmf(src2, tmp_path / "out", tokenizer_from=byte_tokenizer)


def test_num_iter_zero_skips_the_solve(tmp_path, byte_tokenizer):
    """hmf's num_iter = 0 (no ridge regression: plain gated linear attention) converts to kvfree's use_solver."""
    src = _edited(tmp_path, "gka_fp32", lambda c: c["gka_config"].update(num_iter=0))
    dst = convert_hmf(src, tmp_path / "out", tokenizer_from=byte_tokenizer)
    gka = json.loads((dst / "config.json").read_text())["gka"]
    assert gka["use_solver"] is False and gka["num_q_heads"] == 4 and gka["num_k_heads"] == 2


def test_use_forgetting_gate_kk_false_converts_and_runs(tmp_path, byte_tokenizer):
    """hmf's use_forgetting_gate_kk = false (the key covariance never decays, the state does) converts to kvfree's
    flag of the same name, and the model runs it: prefill then decode gives its training forward's logits, which
    differ from the default's."""
    src = _edited(tmp_path, "gka_fp32", lambda c: c["gka_config"].update(use_forgetting_gate_kk=False))
    dst = convert_hmf(src, tmp_path / "out", tokenizer_from=byte_tokenizer)
    assert json.loads((dst / "config.json").read_text())["gka"]["use_forgetting_gate_kk"] is False
    model = load_model(dst, device="cpu", dtype="float32")
    default = load_model(convert_hmf(FIXTURES / "gka_fp32", tmp_path / "default", tokenizer_from=byte_tokenizer),
                         device="cpu", dtype="float32")  # fmt: skip
    assert model.config.gka.use_forgetting_gate_kk is False and default.config.gka.use_forgetting_gate_kk is True
    ids = load_file(str(FIXTURES / "gka_fp32" / "expected.safetensors"))["input_ids"].tolist()
    pool = StatePool(model, capacity=2, max_context=128)
    with torch.inference_mode():
        full = model(torch.tensor([ids]))[0]
        rows = [model.prefill(torch.tensor(ids[:-3]), pool.tensors, StepBatch.prefill([1], [len(ids) - 3]))]
        rows += [model.decode(torch.tensor([t]), pool.tensors, StepBatch.decode([1])) for t in ids[-3:-1]]
        assert rel_err(torch.cat(rows), full[-4:-1]) <= TOLERANCE["fp32"]
        assert rel_err(default(torch.tensor([ids]))[0], full) > 1e-3


def test_cli_converts_an_hmf_directory(tmp_path, byte_tokenizer):
    out = subprocess.run(
        [sys.executable, "-m", "kvfree", "convert", "--from", "hmf", str(FIXTURES / "gka_fp32"), str(tmp_path / "kv"),
         "--tokenizer", str(byte_tokenizer)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    config = json.loads((tmp_path / "kv" / "config.json").read_text())
    assert config["layers"] == ["attention", "gka", "attention"]
    assert config["notes"]["pattern"] == "*-GKA-*"


def _thinking_tokenizer(path: Path) -> Path:
    """kvfree's byte tokenizer with Qwen3's `<think>` and `</think>` added as single tokens."""
    write_byte_tokenizer(path)
    data = json.loads((path / "tokenizer.json").read_text())
    next_id = max(t["id"] for t in data["added_tokens"]) + 1
    for i, tag in enumerate(("<think>", "</think>")):
        data["added_tokens"].append({"id": next_id + i, "content": tag, "single_word": False, "lstrip": False,
                                     "rstrip": False, "normalized": False, "special": False})  # fmt: skip
    (path / "tokenizer.json").write_text(json.dumps(data))
    return path


def test_converter_declares_qwen3_thinking_tags_when_the_tokenizer_has_them(tmp_path, byte_tokenizer):
    dst = convert_hmf(FIXTURES / "gka_fp32", tmp_path / "kv", tokenizer_from=_thinking_tokenizer(tmp_path / "tok"))
    tok_config = json.loads((dst / "tokenizer_config.json").read_text())
    assert (tok_config["reasoning_start"], tok_config["reasoning_end"]) == ("<think>", "</think>")
    # Without the tags in the vocabulary, nothing is declared (the replies then have no reasoning part).
    plain = convert_hmf(FIXTURES / "gka_fp32", tmp_path / "kv2", tokenizer_from=byte_tokenizer)
    assert "reasoning_start" not in json.loads((plain / "tokenizer_config.json").read_text())


def test_derived_keys_hmf_saves_are_accepted_when_they_agree(tmp_path, byte_tokenizer):
    """hmf's setup writes the derived head shape into gka_config / mamba2_config beside the user keys."""
    derived_gka = {"hidden_size": 64, "head_dim": 32, "num_q_heads": 4, "num_k_heads": 2, "num_v_heads": 2}
    src = _edited(tmp_path / "g", "gka_fp32", lambda c: c["gka_config"].update(derived_gka))
    assert convert_hmf(src, tmp_path / "g_out", tokenizer_from=byte_tokenizer).is_dir()
    ssm_cfg = {"expand": 1, "ngroups": 4, "d_state": 32}
    derived_m2 = {"d_model": 64, "d_inner": 128, "d_xb": 64, "intermediate_size": 64, "hidden_act": "silu",
                  "n_layer": 3, "rms_norm_eps": 1e-6, "ssm_cfg": ssm_cfg}  # fmt: skip
    src = _edited(tmp_path / "m", "m2_fp32", lambda c: c["mamba2_config"].update(derived_m2))
    assert convert_hmf(src, tmp_path / "m_out", tokenizer_from=byte_tokenizer).is_dir()
    derived_bmf = {"hidden_size": 64, "num_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-6}
    src = _edited(tmp_path / "f", "bmf_bf16", lambda c: c["bmojo_config"].update(derived_bmf))
    assert convert_hmf(src, tmp_path / "f_out", tokenizer_from=byte_tokenizer).is_dir()
    bad = _edited(tmp_path / "b", "gka_fp32", lambda c: c["gka_config"].update(head_dim=16))
    with pytest.raises(CheckpointError, match="gka_config.head_dim is 16 but the model's shape implies 32"):
        convert_hmf(bad, tmp_path / "b_out", tokenizer_from=byte_tokenizer)

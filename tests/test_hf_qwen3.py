"""HF Qwen3 -> kvfree: a random `Qwen3ForCausalLM` made with transformers, converted, must give transformers' logits
(fp32, relative error <= 1e-4) through kvfree's training forward and through its serving path (a prefill in two
pieces, then decode steps on a state pool), and the same greedy tokens. Plus the converter's refusals."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from kvfree.checkpoints import CheckpointError
from kvfree.checkpoints.byte_tokenizer import write_byte_tokenizer
from kvfree.checkpoints.hf_qwen3 import convert_hf_qwen3
from kvfree.engine.model.loader import load_model
from kvfree.engine.model.step_batch import StepBatch
from kvfree.engine.state.pool import StatePool
from tests.conftest import rel_err

transformers = pytest.importorskip("transformers")


def make_hf_qwen3(path, *, sliding: bool, tie: bool = False, seed: int = 0):
    """A small random Qwen3 (head_dim != hidden / heads, GQA, all weights and norms random) saved with kvfree's byte
    tokenizer; with `sliding`, layers from the second on attend a window of 6 tokens."""
    vocab = write_byte_tokenizer(path)
    with torch.inference_mode(False):
        torch.manual_seed(seed)
        config = transformers.Qwen3Config(
            vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=24, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=tie,
            use_sliding_window=sliding, sliding_window=6 if sliding else None, max_window_layers=1,
            eos_token_id=256, bos_token_id=256, pad_token_id=256,
        )  # fmt: skip
        model = transformers.Qwen3ForCausalLM(config).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))  # norms away from 1, so a missed norm cannot pass
        model.save_pretrained(path)
    return model


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode(False), torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("sliding", [False, True])
def test_converted_qwen3_matches_transformers(tmp_path, sliding):
    hf = make_hf_qwen3(tmp_path / "hf", sliding=sliding)
    dst = convert_hf_qwen3(tmp_path / "hf", tmp_path / "kv")
    config = json.loads((dst / "config.json").read_text())
    assert config["layers"] == (["attention", "swa", "swa"] if sliding else ["attention"] * 3)
    model = load_model(dst, device="cpu", dtype="float32")
    ids = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    want = hf_logits(hf, ids)

    assert rel_err(model(torch.tensor([ids]))[0], want) <= 1e-4  # the training forward

    pool = StatePool(model, capacity=3, max_context=64)
    rows = [model.prefill(torch.tensor(ids[:7]), pool.tensors, StepBatch.prefill([2], [7]), all_logits=True)]
    rows.append(model.prefill(torch.tensor(ids[7:12]), pool.tensors, StepBatch.prefill([2], [5]), all_logits=True))
    for t in range(12, 20):  # decode steps: teacher-forced, so every position is compared
        rows.append(model.decode(torch.tensor([ids[t]]), pool.tensors, StepBatch.decode([2])))
    assert rel_err(torch.cat(rows), want) <= 1e-4

    # greedy continuations agree token for token
    tokens, hf_tokens, cur = [], [], list(ids)
    for _ in range(6):
        hf_tokens.append(int(hf_logits(hf, cur)[-1].argmax()))
        cur.append(hf_tokens[-1])
    cur = torch.tensor([hf_tokens[0]])
    for _ in range(6):
        tokens.append(int(cur))
        cur = model.decode(cur, pool.tensors, StepBatch.decode([2])).argmax(-1)
    assert tokens == hf_tokens


def test_tied_embeddings_and_the_cli(tmp_path):
    make_hf_qwen3(tmp_path / "hf", sliding=False, tie=True, seed=3)
    result = subprocess.run(
        [sys.executable, "-m", "kvfree", "convert", "--from", "hf-qwen3", str(tmp_path / "hf"), str(tmp_path / "kv")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads((tmp_path / "kv" / "config.json").read_text())["tie_word_embeddings"] is True
    assert load_model(tmp_path / "kv", device="cpu").lm_head is None


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "llama"}, "expected 'qwen3'"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "RoPE type 'yarn'"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}, "RoPE type 'linear'"),
        ({"layer_types": ["full_attention", "linear_attention", "full_attention"]}, "unknown layer type"),
        ({"num_key_value_heads": 3}, "must divide"),
        ({"hidden_act": "gelu"}, "only 'silu'"),
        ({"num_hidden_layers": 2, "layer_types": ["full_attention"] * 2}, "unexpected HF tensor 'model.layers.2"),
        ({"num_hidden_layers": 2}, "layer_types must list 2"),
    ],
)
def test_refusals_name_what_to_fix(tmp_path, change, message):
    make_hf_qwen3(tmp_path / "hf", sliding=False)
    path = tmp_path / "hf" / "config.json"
    config = json.loads(path.read_text())
    if "rope_scaling" in change:  # transformers 5 writes rope_parameters, older versions rope_scaling
        config.pop("rope_parameters", None)
    path.write_text(json.dumps(config | change))
    with pytest.raises(CheckpointError, match=message):
        convert_hf_qwen3(tmp_path / "hf", tmp_path / "kv")
    assert not (tmp_path / "kv").exists()

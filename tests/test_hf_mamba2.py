"""Converting HF `Mamba2ForCausalLM` checkpoints: our model must reproduce transformers' own PyTorch Mamba-2.

The oracle is a tiny random `Mamba2ForCausalLM` built and run by transformers (its reference PyTorch path, no
mamba_ssm kernels), saved with `save_pretrained`, converted with `convert_hf_mamba2` and loaded with `load_model`.
Every parameter is randomised (A_log, D, dt_bias and the norms too), so no trivial init can hide a mismatch.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvfree.checkpoints import CheckpointError, read_checkpoint
from kvfree.checkpoints.byte_tokenizer import write_byte_tokenizer
from kvfree.checkpoints.hf_mamba2 import convert_hf_mamba2
from kvfree.engine.model.config import ModelConfig
from kvfree.engine.model.hybrid_lm import HybridLM
from kvfree.engine.model.loader import load_model
from kvfree.engine.model.step_batch import StepBatch
from kvfree.engine.state.pool import StatePool
from tests.conftest import rel_err

transformers = pytest.importorskip("transformers")

VOCAB = 261  # the byte tokenizer's vocabulary
PROMPT_LEN = 41  # spans 3 chunks of 16, the last one partial
NEW_TOKENS = 20
RTOL = 1e-4

TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    num_heads=8,
    head_dim=16,
    expand=2,
    state_size=16,
    n_groups=2,
    conv_kernel=4,
    chunk_size=16,
    bos_token_id=256,
    eos_token_id=256,
    pad_token_id=256,
)


@torch.no_grad()
def randomise(model: torch.nn.Module, seed: int) -> None:
    """Give every parameter of an HF Mamba2ForCausalLM a non-trivial random value, in a realistic range."""
    g = torch.Generator().manual_seed(seed)

    def normal(p: torch.Tensor, mean: float, std: float) -> None:
        p.copy_(mean + std * torch.randn(p.shape, generator=g))

    def uniform(p: torch.Tensor, lo: float, hi: float) -> None:
        p.copy_(lo + (hi - lo) * torch.rand(p.shape, generator=g))

    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 2)
        if name.endswith("A_log"):
            p.copy_(torch.log(1 + 15 * torch.rand(p.shape, generator=g)))  # A in -[1, 16]
        elif name.endswith(".D"):
            normal(p, 1.0, 0.5)
        elif name.endswith("dt_bias"):
            uniform(p, -4.0, 1.0)  # softplus -> dt roughly in [0.02, 1.3]
        elif leaf[-2] in ("norm", "norm_f"):
            normal(p, 1.0, 0.2)
        elif "conv1d" in name:
            uniform(p, -0.5, 0.5)
        elif name.endswith("bias"):
            normal(p, 0.0, 0.1)
        elif "embeddings" in name:
            normal(p, 0.0, 1.0)
        else:  # in_proj, out_proj, lm_head
            normal(p, 0.0, p.shape[-1] ** -0.5)


def make_hf(tmp: Path, seed: int = 0, **overrides: object) -> tuple[torch.nn.Module, Path]:
    """A random tiny Mamba2ForCausalLM, and the directory it was saved to."""
    config = transformers.Mamba2Config(**{**TINY, **overrides})
    torch.manual_seed(seed)
    model = transformers.Mamba2ForCausalLM(config).eval()
    randomise(model, seed)
    if config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.backbone.embeddings.weight.data_ptr()
    path = tmp / "hf"
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer")
    write_byte_tokenizer(path)
    return path


def convert_and_load(hf_dir: Path, dst: Path, tokenizer: Path) -> HybridLM:
    convert_hf_mamba2(hf_dir, dst, tokenizer_from=tokenizer)
    return load_model(dst, device="cpu", dtype="float32")


def our_prefill(model: HybridLM, ids: torch.Tensor, pieces: list[int] | None = None) -> tuple[torch.Tensor, ...]:
    """Whole-prompt logits `[T, V]` (fed in `pieces` if given), and the pool + slot holding the session."""
    pool = StatePool(model, capacity=2)
    pool.alloc()  # slot 0 stays idle, so the session's slot index is not 0
    slot = pool.alloc()
    logits, start = [], 0
    for n in pieces or [len(ids)]:
        batch = StepBatch.prefill([slot], [n])
        logits.append(model.prefill(ids[start : start + n], pool.tensors, batch, all_logits=True))
        start += n
    return torch.cat(logits), pool, slot


def hf_greedy(model: torch.nn.Module, ids: torch.Tensor, steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding with HF's own cache: prefill once, then one token per forward."""
    out = model(ids[None], use_cache=True)
    cache, step_logits, tokens = out.cache_params, [out.logits[0, -1]], []
    for _ in range(steps):
        tok = int(step_logits[-1].argmax())
        tokens.append(tok)
        out = model(torch.tensor([[tok]]), cache_params=cache, use_cache=True)
        cache = out.cache_params
        step_logits.append(out.logits[0, -1])
    return tokens, step_logits


def our_greedy(model: HybridLM, ids: torch.Tensor, steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding with our engine: prefill, then `decode` one token at a time."""
    logits, pool, slot = our_prefill(model, ids)
    slots = torch.tensor([slot])
    step_logits, tokens = [logits[-1]], []
    for _ in range(steps):
        tok = int(step_logits[-1].argmax())
        tokens.append(tok)
        step_logits.append(model.decode(torch.tensor([tok]), pool.tensors, StepBatch.decode(slots))[0])
    return tokens, step_logits


VARIANTS = {
    "tied": dict(tie_word_embeddings=True),
    "untied": dict(tie_word_embeddings=False),
    "bias-noconvbias": dict(tie_word_embeddings=False, use_bias=True, use_conv_bias=False),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, byte_tokenizer: Path):
    """(HF model, our converted model, prompt) for each config variant."""
    tmp = tmp_path_factory.mktemp(request.param)
    hf, hf_dir = make_hf(tmp, seed=len(request.param), **VARIANTS[request.param])
    ours = convert_and_load(hf_dir, tmp / "ours", byte_tokenizer)
    assert ("lm_head.weight" in read_checkpoint(tmp / "ours").tensors) != hf.config.tie_word_embeddings
    prompt = torch.randint(0, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1))
    return hf, ours, prompt


# -- numerics ----------------------------------------------------------------------------------------------------
@torch.no_grad()
def test_prompt_logits_match_hf(pair) -> None:
    hf, ours, prompt = pair
    want = hf(prompt[None]).logits[0]
    got, _, _ = our_prefill(ours, prompt)
    assert got.shape == want.shape == (PROMPT_LEN, VOCAB)
    assert rel_err(got, want) <= RTOL


@torch.no_grad()
def test_prompt_in_pieces_matches_hf(pair) -> None:
    """Prefill split mid-chunk (state carried across calls) still gives HF's whole-prompt logits."""
    hf, ours, prompt = pair
    want = hf(prompt[None]).logits[0]
    got, _, _ = our_prefill(ours, prompt, pieces=[7, 20, PROMPT_LEN - 27])
    assert rel_err(got, want) <= RTOL


@torch.no_grad()
def test_greedy_decode_matches_hf(pair) -> None:
    hf, ours, prompt = pair
    hf_tokens, hf_logits = hf_greedy(hf, prompt, NEW_TOKENS)
    our_tokens, our_logits = our_greedy(ours, prompt, NEW_TOKENS)
    assert our_tokens == hf_tokens
    for step, (a, b) in enumerate(zip(our_logits, hf_logits, strict=True)):
        assert rel_err(a, b) <= RTOL, f"step {step}: relative error {rel_err(a, b):.2e}"


@torch.no_grad()
def test_time_step_limit_converts_and_matches_hf(tmp_path: Path, byte_tokenizer: Path) -> None:
    """A finite dt clamp carries over.

    HF's PyTorch decode step (`mamba2_selective_state_update`) ignores `time_step_limit` while its prefill clamps,
    so HF's own cached decoding disagrees with HF's full forward here. The oracle for our decode steps is therefore
    HF's full forward over prompt + generated tokens.
    """
    hf, hf_dir = make_hf(tmp_path, seed=3, time_step_limit=(0.05, 0.4))
    ours = convert_and_load(hf_dir, tmp_path / "ours", byte_tokenizer)
    assert ours.config.mamba2.time_step_limit == pytest.approx([0.05, 0.4])
    prompt = torch.randint(0, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(2))
    got, _, _ = our_prefill(ours, prompt)
    assert rel_err(got, hf(prompt[None]).logits[0]) <= RTOL

    steps = 8
    tokens, step_logits = our_greedy(ours, prompt, steps)
    want = hf(torch.cat([prompt, torch.tensor(tokens)])[None]).logits[0, PROMPT_LEN - 1 :]
    assert tokens == want[:-1].argmax(-1).tolist()
    assert rel_err(torch.stack(step_logits), want) <= RTOL


# -- config and file formats -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved_untied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    _, hf_dir = make_hf(tmp_path_factory.mktemp("untied"), seed=5, tie_word_embeddings=False)
    return hf_dir


def test_converted_config(saved_untied: Path, tmp_path: Path, byte_tokenizer: Path) -> None:
    dst = convert_hf_mamba2(saved_untied, tmp_path / "ours", tokenizer_from=byte_tokenizer)
    raw = json.loads((dst / "config.json").read_text())
    assert raw["layers"] == ["mamba2", "mamba2"]
    assert "time_step_limit" not in raw["mamba2"]  # HF's (0, inf) default means no clamp
    assert raw["notes"] == {"converted_from": "hf-mamba2", "source": str(saved_untied)}
    config = ModelConfig.from_dict(raw)
    assert config.mamba2.time_step_limit is None
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (256, 256, 256)
    assert config.mamba2.chunk_size == 16 and config.mamba2.norm_eps == config.norm_eps == 1e-5
    assert "lm_head.weight" in read_checkpoint(dst).tensors


def test_time_step_limit_infinite_max(saved_untied: Path, tmp_path: Path, byte_tokenizer: Path) -> None:
    hf_config = json.loads((saved_untied / "config.json").read_text())
    hf_config["time_step_limit"] = [0.001, {"__float__": "Infinity"}]
    hf_config["chunk_size"] = 1024
    src = tmp_path / "inf"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(hf_config))
    (src / "model.safetensors").symlink_to(saved_untied / "model.safetensors")
    raw = json.loads((convert_hf_mamba2(src, tmp_path / "o", byte_tokenizer) / "config.json").read_text())
    assert raw["mamba2"]["time_step_limit"] == [0.001, 1e30]
    assert raw["mamba2"]["chunk_size"] == 256
    assert math.isfinite(raw["mamba2"]["time_step_limit"][1])


def _same_tensors(a: Path, b: Path) -> None:
    ta, tb = read_checkpoint(a).tensors, read_checkpoint(b).tensors
    assert ta.keys() == tb.keys()
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k


def test_sharded_safetensors_and_bin(saved_untied: Path, tmp_path: Path, byte_tokenizer: Path) -> None:
    ref = convert_hf_mamba2(saved_untied, tmp_path / "ref", byte_tokenizer)
    tensors = load_file(saved_untied / "model.safetensors")
    config = (saved_untied / "config.json").read_text()

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text(config)
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        shard = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: tensors[k] for k in part}, sharded / shard)
        weight_map.update(dict.fromkeys(part, shard))
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    _same_tensors(ref, convert_hf_mamba2(sharded, tmp_path / "from-sharded", byte_tokenizer))

    binary = tmp_path / "bin"
    binary.mkdir()
    (binary / "config.json").write_text(config)
    torch.save(tensors, binary / "pytorch_model.bin")
    _same_tensors(ref, convert_hf_mamba2(binary, tmp_path / "from-bin", byte_tokenizer))


# -- tokenizer files ---------------------------------------------------------------------------------------------
def test_tokenizer_from_src_without_tokenizer_config(saved_untied: Path, tmp_path: Path, byte_tokenizer: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("config.json", "model.safetensors"):
        (src / name).symlink_to(saved_untied / name)
    with pytest.raises(CheckpointError, match="tokenizer directory"):
        convert_hf_mamba2(src, tmp_path / "no-tok")
    assert not (tmp_path / "no-tok").exists()

    (src / "tokenizer.json").write_bytes((byte_tokenizer / "tokenizer.json").read_bytes())
    dst = convert_hf_mamba2(src, tmp_path / "ours")
    tok_config = json.loads((dst / "tokenizer_config.json").read_text())
    assert tok_config["eos_token"] == tok_config["bos_token"] == "<|endoftext|>"  # id 256
    assert "chat_template" not in tok_config
    assert (dst / "tokenizer.json").read_bytes() == (byte_tokenizer / "tokenizer.json").read_bytes()
    assert not (src / "tokenizer_config.json").exists()  # the source directory is left alone


# -- errors ------------------------------------------------------------------------------------------------------
def test_error_not_mamba2(saved_untied: Path, tmp_path: Path, byte_tokenizer: Path) -> None:
    src = tmp_path / "llama"
    src.mkdir()
    hf_config = json.loads((saved_untied / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**hf_config, "model_type": "llama"}))
    (src / "model.safetensors").symlink_to(saved_untied / "model.safetensors")
    with pytest.raises(CheckpointError, match="model_type.*llama"):
        convert_hf_mamba2(src, tmp_path / "o", byte_tokenizer)


def test_error_missing_tensor(saved_untied: Path, tmp_path: Path, byte_tokenizer: Path) -> None:
    src = tmp_path / "partial"
    src.mkdir()
    (src / "config.json").write_text((saved_untied / "config.json").read_text())
    tensors = load_file(saved_untied / "model.safetensors")
    del tensors["backbone.layers.1.mixer.dt_bias"]
    save_file(tensors, src / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"backbone\.layers\.1\.mixer\.dt_bias"):
        convert_hf_mamba2(src, tmp_path / "o", byte_tokenizer)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"expand": 3}, "expand"),
        ({"num_heads": "8"}, "num_heads"),
    ],
)
def test_error_bad_config(saved_untied: Path, tmp_path: Path, byte_tokenizer: Path, edit: dict, match: str) -> None:
    src = tmp_path / "bad"
    src.mkdir()
    hf_config = json.loads((saved_untied / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**hf_config, **edit}))
    (src / "model.safetensors").symlink_to(saved_untied / "model.safetensors")
    with pytest.raises(CheckpointError, match=match):
        convert_hf_mamba2(src, tmp_path / "o", byte_tokenizer)


def test_error_missing_files(saved_untied: Path, tmp_path: Path, byte_tokenizer: Path) -> None:
    with pytest.raises(CheckpointError, match="no such HF checkpoint directory"):
        convert_hf_mamba2(tmp_path / "nowhere", tmp_path / "o", byte_tokenizer)
    src = tmp_path / "empty"
    src.mkdir()
    with pytest.raises(CheckpointError, match="config.json"):
        convert_hf_mamba2(src, tmp_path / "o", byte_tokenizer)
    (src / "config.json").write_text((saved_untied / "config.json").read_text())
    with pytest.raises(CheckpointError, match="no weights"):
        convert_hf_mamba2(src, tmp_path / "o", byte_tokenizer)

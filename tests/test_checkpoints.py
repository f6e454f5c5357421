"""Checkpoints: a valid checkpoint round-trips, and each kind of damage is refused with an error naming its cause."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvfree.checkpoints import (
    CONFIG_FILE,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    CheckpointError,
    read_checkpoint,
)
from kvfree.engine import LLM, ModelConfig, SamplingParams
from kvfree.engine.model.config import ConfigError
from kvfree.engine.model.loader import load_model
from kvfree.engine.model.presets import PRESETS, init_checkpoint, preset_config

ALL_FILES = {CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE, TOKENIZER_CONFIG_FILE}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return init_checkpoint("tiny", tmp_path_factory.mktemp("ckpt") / "tiny", seed=3)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory) -> Path:
    return init_checkpoint("tiny-hybrid", tmp_path_factory.mktemp("ckpt") / "hybrid", seed=4)


@pytest.fixture(params=["tiny", "hybrid"])
def base(request) -> Path:
    return request.getfixturevalue(request.param)


@pytest.fixture
def copy(base, tmp_path) -> Path:
    """A private copy of a valid checkpoint, to damage."""
    return Path(shutil.copytree(base, tmp_path / "copy"))


def _edit_tensors(path: Path, edit) -> None:
    tensors = load_file(path / WEIGHTS_FILE)
    edit(tensors)
    save_file(tensors, path / WEIGHTS_FILE)


def _edit_config(path: Path, edit) -> None:
    cfg = json.loads((path / CONFIG_FILE).read_text())
    edit(cfg)
    (path / CONFIG_FILE).write_text(json.dumps(cfg))


def _tensor_names(path: Path) -> list[str]:
    return sorted(load_file(path / WEIGHTS_FILE))


# -- valid checkpoints ---------------------------------------------------------------------------------------------


def test_init_checkpoint_writes_all_files(base):
    assert {p.name for p in base.iterdir()} == ALL_FILES
    cfg = json.loads((base / CONFIG_FILE).read_text())
    assert ModelConfig.from_dict(cfg) == preset_config("tiny" if base.name == "tiny" else "tiny-hybrid")


def test_load_model_round_trips_saved_tensors(base):
    saved = load_file(base / WEIGHTS_FILE)
    model = load_model(base, device="cpu")
    state = model.state_dict()
    assert set(state) == set(saved)
    for name, tensor in saved.items():
        assert state[name].dtype == torch.float32
        assert torch.equal(state[name], tensor), name
    # Weights are random, not a constant fill: a test on zeros would miss swapped tensors.
    assert any(t.std() > 0 for t in saved.values())
    assert model.config == ModelConfig.from_dict(json.loads((base / CONFIG_FILE).read_text()))


def test_init_checkpoint_is_seeded(tmp_path, tiny):
    again = load_file(init_checkpoint("tiny", tmp_path / "again", seed=3) / WEIGHTS_FILE)
    other = load_file(init_checkpoint("tiny", tmp_path / "other", seed=4) / WEIGHTS_FILE)
    ref = load_file(tiny / WEIGHTS_FILE)
    assert all(torch.equal(again[k], ref[k]) for k in ref)
    assert not all(torch.equal(other[k], ref[k]) for k in ref)


def test_bfloat16_checkpoint_loads_as_float32_on_cpu(tmp_path):
    path = init_checkpoint("tiny", tmp_path / "bf16", seed=5, dtype=torch.bfloat16)
    saved = load_file(path / WEIGHTS_FILE)
    assert all(t.dtype == torch.bfloat16 for t in saved.values())
    model = load_model(path, device="cpu")
    assert model.dtype == torch.float32
    state = model.state_dict()
    for name, tensor in saved.items():
        assert torch.equal(state[name], tensor.float()), name
    kept = load_model(path, device="cpu", dtype="bfloat16").state_dict()
    assert all(kept[k].dtype == torch.bfloat16 and torch.equal(kept[k], saved[k]) for k in saved)


def test_llm_generates_from_initialised_checkpoint(base):
    llm = LLM(base, device="cpu", max_sessions=2, max_context=64)
    outs = llm.generate(["Hello", "abc"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    for out in outs:
        assert len(out.token_ids) == 6 and out.finish_reason == "length"
        assert all(0 <= t < llm.config.vocab_size for t in out.token_ids)
    assert outs[0].prompt_token_ids == list(b"Hello")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_config_round_trips(name, tmp_path):
    cfg = ModelConfig.from_dict(PRESETS[name])
    assert cfg.vocab_size == PRESETS[name]["vocab_size"] and cfg.layers == PRESETS[name]["layers"]
    again = ModelConfig.from_dict(cfg.to_dict())
    assert again == cfg
    assert again.to_dict() == cfg.to_dict()
    cfg.save(tmp_path / "config.json")
    assert ModelConfig.load(tmp_path / "config.json") == cfg
    # to_dict is plain JSON and keeps every value the preset set.
    d = cfg.to_dict()
    assert json.loads(json.dumps(d)) == d
    for key, value in PRESETS[name].items():
        if isinstance(value, dict):
            assert d[key] == {**d[key], **value}, key
        else:
            assert d[key] == value, key


def test_non_default_values_survive_the_round_trip(tmp_path):
    data = json.loads(json.dumps(PRESETS["tiny-hybrid"]))
    data["norm_eps"] = 1e-6
    data["tie_word_embeddings"] = False
    data["mamba2"].update(time_step_limit=[0.001, 0.1], chunk_size=32, use_bias=True, norm_eps=1e-4)
    data["attention"].update(rope_theta=500000.0, use_bias=True)
    data["notes"] = {"source": "test"}
    cfg = ModelConfig.from_dict(data)
    assert cfg.to_dict() == {**cfg.to_dict(), **{k: v for k, v in data.items() if not isinstance(v, dict)}}
    cfg.save(tmp_path / "config.json")
    again = ModelConfig.load(tmp_path / "config.json")
    assert again == cfg
    assert again.norm_eps == 1e-6 and again.mamba2.time_step_limit == [0.001, 0.1]
    assert again.attention.rope_theta == 500000.0 and not again.tie_word_embeddings
    assert again.notes == {"source": "test"}


# -- damaged tensors -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pick", [0, 7, -1])
def test_missing_tensor_is_named(copy, pick):
    name = _tensor_names(copy)[pick]
    _edit_tensors(copy, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match="missing tensor") as e:
        load_model(copy, device="cpu")
    assert repr(name) in str(e.value)


@pytest.mark.parametrize("pick", [1, 9, -2])
def test_wrong_shape_names_tensor_and_both_shapes(copy, pick):
    name = _tensor_names(copy)[pick]
    shapes = {}

    def grow(t):
        old = t[name]
        shapes["old"] = tuple(old.shape)
        t[name] = torch.randn(old.shape[0] + 3, *old.shape[1:], generator=torch.Generator().manual_seed(pick + 10))
        shapes["new"] = tuple(t[name].shape)

    _edit_tensors(copy, grow)
    with pytest.raises(CheckpointError) as e:
        load_model(copy, device="cpu")
    msg = str(e.value)
    assert repr(name) in msg
    assert str(shapes["old"]) in msg and str(shapes["new"]) in msg


def test_extra_tensor_is_named(copy):
    extra = "layers.0.mixer.bogus_weight"
    _edit_tensors(copy, lambda t: t.update({extra: torch.randn(4, generator=torch.Generator().manual_seed(1))}))
    with pytest.raises(CheckpointError, match="unexpected tensor") as e:
        load_model(copy, device="cpu")
    assert repr(extra) in str(e.value)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_tensor_is_named(copy, bad):
    name = _tensor_names(copy)[5]

    def poison(t):
        t[name] = t[name].clone()
        t[name].view(-1)[t[name].numel() // 2] = bad

    _edit_tensors(copy, poison)
    with pytest.raises(CheckpointError, match="NaN or Inf") as e:
        load_model(copy, device="cpu")
    assert repr(name) in str(e.value)


def test_integer_tensor_is_named(copy):
    name = _tensor_names(copy)[2]
    _edit_tensors(copy, lambda t: t.update({name: torch.ones_like(t[name], dtype=torch.int32)}))
    with pytest.raises(CheckpointError, match="dtype") as e:
        load_model(copy, device="cpu")
    assert repr(name) in str(e.value)


def test_truncated_weights_file(copy):
    data = (copy / WEIGHTS_FILE).read_bytes()
    (copy / WEIGHTS_FILE).write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=WEIGHTS_FILE):
        load_model(copy, device="cpu")


# -- damaged config ------------------------------------------------------------------------------------------------


def _set(*keys_and_value):
    *keys, value = keys_and_value

    def edit(cfg):
        d = cfg
        for k in keys[:-1]:
            d = d[k]
        d[keys[-1]] = value

    return edit


CONFIG_DAMAGE = [
    (_set("hidden_size", "128"), "config.hidden_size"),
    (_set("vocab_size", 261.0), "config.vocab_size"),
    (_set("mamba2", "head_dim", True), "config.mamba2.head_dim"),
    (_set("layers", "mamba2"), "config.layers"),
    (_set("mamba2", "num_heads", 8.5), "config.mamba2.num_heads"),
    (_set("mamba2", "use_bias", 0), "config.mamba2.use_bias"),
    (_set("tie_word_embeddings", 1), "config.tie_word_embeddings"),
    (_set("norm_eps", True), "config.norm_eps"),
    (_set("mamba2", "time_step_limit", [0.0]), "config.mamba2.time_step_limit"),
    (_set("mamba2", "n_groups", 3), "config.mamba2.n_groups"),
    (_set("hidden_size", 0), "config.hidden_size"),
    (_set("eos_token_id", 261), "config.eos_token_id"),
    (_set("layers", []), "config.layers"),
    (_set("layers", ["mamba2", "mamba2", "mamba3"]), r"config.layers\[2\]"),
    (_set("layers", ["mamba2", "swa"]), "config.swa"),
    (_set("rope_scaling", 2.0), "config.rope_scaling"),
    (_set("mamba2", "d_state", 16), "config.mamba2.d_state"),
    (lambda cfg: cfg.pop("hidden_size"), "config.hidden_size"),
    (lambda cfg: cfg["mamba2"].pop("num_heads"), "config.mamba2.num_heads"),
    (_set("mamba2", [1, 2]), "config.mamba2"),
    (_set("notes", {"source": 3}), "config.notes.source"),
]


@pytest.mark.parametrize(("edit", "key"), CONFIG_DAMAGE, ids=[k for _, k in CONFIG_DAMAGE])
def test_bad_config_names_the_key(copy, edit, key):
    cfg = json.loads((copy / CONFIG_FILE).read_text())
    edit(cfg)
    with pytest.raises(ConfigError, match=key):
        ModelConfig.from_dict(cfg)
    (copy / CONFIG_FILE).write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=key) as e:
        load_model(copy, device="cpu")
    assert CONFIG_FILE in str(e.value)


def test_layer_kind_without_its_sub_config(tmp_path, tiny):
    cfg = json.loads((tiny / CONFIG_FILE).read_text())
    cfg["layers"] = ["mamba2", "attention"]
    with pytest.raises(ConfigError, match=r"config.attention: layer 1 is 'attention'"):
        ModelConfig.from_dict(cfg)


def test_config_changing_the_model_is_caught_as_tensor_mismatch(copy):
    _edit_config(copy, _set("hidden_size", 96))
    with pytest.raises(CheckpointError, match="shape"):
        load_model(copy, device="cpu")


def test_fewer_layers_in_config_means_unexpected_tensors(copy):
    _edit_config(copy, lambda cfg: cfg["layers"].pop())
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'layers\.3\."):
        load_model(copy, device="cpu")


# -- missing and unreadable files ----------------------------------------------------------------------------------


@pytest.mark.parametrize("missing", [CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE])
def test_missing_file_is_named(copy, missing):
    (copy / missing).unlink()
    with pytest.raises(CheckpointError, match=f"missing {missing}"):
        read_checkpoint(copy)
    with pytest.raises(CheckpointError, match=f"missing {missing}"):
        LLM(copy, device="cpu")


def test_missing_directory_is_named(tmp_path):
    path = tmp_path / "nowhere"
    with pytest.raises(CheckpointError, match="no such checkpoint directory") as e:
        load_model(path, device="cpu")
    assert str(path) in str(e.value)


@pytest.mark.parametrize("text", ['{"hidden_size": 128,', "", "[1, 2, 3]", "null"])
def test_malformed_config_json(copy, text):
    (copy / CONFIG_FILE).write_text(text)
    with pytest.raises(CheckpointError, match=CONFIG_FILE):
        load_model(copy, device="cpu")


def test_malformed_tokenizer_json(copy):
    (copy / TOKENIZER_FILE).write_text("{ not json")
    load_model(copy, device="cpu")  # the model itself is fine
    with pytest.raises(CheckpointError, match=TOKENIZER_FILE):
        LLM(copy, device="cpu")

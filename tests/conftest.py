"""Shared fixtures: small random models of every mixer kind, built in-process (no files, no network)."""

from __future__ import annotations

import math

import pytest
import torch

from engine.config import ModelConfig
from engine.model import HybridLM

VOCAB = 261

SUBCONFIGS = {
    "mamba2": {"num_heads": 4, "head_dim": 8, "state_size": 16, "n_groups": 2, "conv_kernel": 4, "chunk_size": 8},
    "attention": {"num_heads": 4, "num_kv_heads": 2, "head_dim": 8},
    "swa": {"num_heads": 4, "num_kv_heads": 2, "head_dim": 8, "window": 6},
}


def make_config(layers: list[str], hidden: int = 32, mlp: bool = False, tied: bool = True) -> ModelConfig:
    data = {
        "vocab_size": VOCAB,
        "hidden_size": hidden,
        "layers": layers,
        "tie_word_embeddings": tied,
        "eos_token_id": 256,
    }
    for kind in set(layers):
        data[kind] = SUBCONFIGS[kind]
    if mlp:
        data["mlp"] = {"intermediate_size": 2 * hidden}
    return ModelConfig.from_dict(data)


def randomize(module: torch.nn.Module, seed: int) -> None:
    """Give every parameter random values (norm weights too), so no test passes because a weight is 1 or 0."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=gen) * 8 + 1))
            elif name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(max(p.shape[-1], 1)))


def make_model(layers: list[str], seed: int = 0, **kw) -> HybridLM:
    model = HybridLM(make_config(layers, **kw))
    randomize(model, seed)
    return model.eval()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.inference_mode():
        yield

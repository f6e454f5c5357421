"""Shared fixtures: small random models of every mixer kind, built in-process (no files, no network)."""

from __future__ import annotations

import math
import os

import pytest
import torch

# Triton kernels run under Triton's interpreter on a machine without a GPU (CI). It must be set before the first
# module that defines a kernel is imported; the default dispatch (`KVFREE_KERNELS=auto`) still picks the PyTorch
# reference on the CPU, so only tests that ask for Triton run it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvfree.engine.model.config import ModelConfig
from kvfree.engine.model.hybrid_lm import HybridLM
from kvfree.engine.model.step_batch import StepBatch

VOCAB = 261

SUBCONFIGS = {
    "mamba2": {"num_heads": 4, "head_dim": 8, "state_size": 16, "n_groups": 2, "conv_kernel": 4, "chunk_size": 8},
    "attention": {"num_heads": 4, "num_kv_heads": 2, "head_dim": 8},
    "swa": {"num_heads": 4, "num_kv_heads": 2, "head_dim": 8, "window": 6},
    "ska": {"num_heads": 2, "rank": 8, "head_dim": 16, "chunk_size": 8},
    "gka": {"num_heads": 2, "head_dim": 16, "chunk_size": 8, "num_iter": 30},
    "gdn": {"num_heads": 2, "head_dim": 16, "num_k_heads": 1, "num_v_heads": 1, "chunk_size": 8},
    "lattice": {"num_heads": 2, "head_dim": 16, "num_slots": 16},
    "bmojo": {
        "num_heads": 2,
        "num_kv_heads": 2,
        "head_dim": 16,
        "ssm_num_heads": 4,
        "ssm_head_dim": 16,
        "ssm_state_size": 8,
        "window": 8,
        "eidetic_tokens": 4,
    },
}


# fp32 output tolerance where a mixer's output is less well conditioned than the default 1e-5 allows: GKA's ridge solve
# (kappa up to 51), an alpha blend that can nearly cancel, then a per-head RMSNorm that scales it back up.
# tests/engine/test_gka.py argues the 1e-3 and checks 1e-12 in float64.
OUTPUT_TOL = {"gka": 1e-3}


def output_tol(kinds: list[str] | str, default: float = 1e-5) -> float:
    """The loosest fp32 output tolerance any of `kinds` needs."""
    kinds = [kinds] if isinstance(kinds, str) else kinds
    return max([default, *(OUTPUT_TOL[k] for k in kinds if k in OUTPUT_TOL)])


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


@pytest.fixture
def poison():
    """Every buffer a Triton op allocates starts as NaN (integers as their minimum), so an element a kernel forgot to
    write shows up in its result (`kvfree.kernels.common.poisoned_outputs`)."""
    from kvfree.kernels.common import poisoned_outputs

    with poisoned_outputs():
        yield


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.inference_mode():
        yield


@pytest.fixture(scope="module")
def one_thread():
    """Run a module's tests with one intra-op thread; opt in with `pytestmark = pytest.mark.usefixtures("one_thread")`.

    For files of many tiny ops (token loops, small models): on the loaded 2-core CI machine, intra-op threads waiting
    on each other made single ops take a scheduler time slice (measured 10-100x slower files; e.g. oneDNN's depthwise
    conv1d ~50 ms per call). One thread changes no result.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- helpers shared by the mixer, pool and snapshot tests ------------------------------------------------------------
def mixer_prefill(mixer, state: dict[str, torch.Tensor], slot: int, x: torch.Tensor) -> torch.Tensor:
    """One session's tokens x `[T, D]` through `mixer.prefill`, continuing the state in `slot`."""
    return mixer.prefill(x, state, StepBatch.prefill([slot], [x.shape[0]]))


def mixer_decode_all(mixer, state: dict[str, torch.Tensor], slot: int, x: torch.Tensor) -> torch.Tensor:
    """The same tokens fed one `decode` step at a time."""
    return torch.cat([mixer.decode(x[t : t + 1], state, StepBatch.decode([slot])) for t in range(x.shape[0])])


def state_rows(state: dict[str, torch.Tensor], slot: int) -> dict[str, torch.Tensor]:
    """A copy of one slot's state tensors."""
    return {k: v[slot].clone() for k, v in state.items()}


def assert_states_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float = 1e-5) -> None:
    """Float state tensors within `tol` relative error; integer ones (counters, positions) exactly equal."""
    for name in a:
        if a[name].is_floating_point():
            assert rel_err(a[name], b[name]) <= tol, name
        else:
            assert torch.equal(a[name], b[name]), name


def model_prefill(model: HybridLM, pool, slot: int, ids: list[int], chunk: int = 4096) -> torch.Tensor:
    """Prefill token `ids` into `slot` in chunks of at most `chunk`; returns the last token's logits `[V]`."""
    logits = None
    for start in range(0, len(ids), chunk):
        piece = torch.tensor(ids[start : start + chunk])
        logits = model.prefill(piece, pool.tensors, StepBatch.prefill([slot], [len(piece)]))
    return logits[0]


def greedy(model: HybridLM, pool, slots: list[int], first: list[int], steps: int):
    """Greedy-decode `steps` tokens for the sessions in `slots`, feeding `first` first.

    Returns (tokens per session, logits `[B, steps, V]`)."""
    tokens, ids, all_logits = [[] for _ in slots], torch.tensor(first), []
    for _ in range(steps):
        logits = model.decode(ids, pool.tensors, StepBatch.decode(slots))
        all_logits.append(logits)
        ids = logits.argmax(-1)
        for row, t in enumerate(ids.tolist()):
            tokens[row].append(t)
    return tokens, torch.stack(all_logits, 1)


def random_ids(n: int, seed: int) -> list[int]:
    """n random byte-range token ids, reproducible by seed."""
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()

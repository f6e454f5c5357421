"""HybridLM: embedding -> pre-norm residual blocks (mixer, optional MLP) -> final norm -> LM head."""

from __future__ import annotations

import torch
from torch import nn

from kvfree.engine.config import ModelConfig
from kvfree.engine.layers import Mixer, PrefillBatch, build_mixer
from kvfree.engine.layers.mlp import KoopmanMLP, build_mlp
from kvfree.engine.layers.norms import RMSNorm

State = list[dict[str, torch.Tensor]]  # per layer: name -> pool tensor [capacity, *shape]


class Block(nn.Module):
    """x = x + mixer(norm(x)); then, if the model has MLPs, x = x + mlp(mlp_norm(x)).

    The MLP kind picks its own pre-norm (`build_mlp`): RMSNorm for SwiGLU, LayerNorm for the Koopman MLP. Either
    way the tensors are `mlp_norm.*` and `mlp.*`, and the block (not the MLP) adds the residual.
    """

    def __init__(self, config: ModelConfig, kind: str) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mixer: Mixer = build_mixer(kind, config)
        self.mlp_norm: nn.Module | None = None
        self.mlp: nn.Module | None = None
        if config.mlp is not None:
            self.mlp_norm, self.mlp = build_mlp(config.hidden_size, config.mlp, config.norm_eps)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        if self.mlp is None:
            return x
        return x + self.mlp(self.mlp_norm(x)).float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._mlp(x + self.mixer(self.norm(x)).float())

    def prefill(self, x: torch.Tensor, state: dict[str, torch.Tensor], batch: PrefillBatch) -> torch.Tensor:
        return self._mlp(x + self.mixer.prefill(self.norm(x), state, batch).float())

    def decode(self, x: torch.Tensor, state: dict[str, torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
        return self._mlp(x + self.mixer.decode(self.norm(x), state, slots).float())


class HybridLM(nn.Module):
    """A language model whose blocks mix tokens with the kinds listed in `config.layers`.

    The residual stream is kept in fp32 whatever the weight dtype (as HF's `residual_in_fp32`).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([Block(config, kind) for kind in config.layers])
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, False)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def init_weights(self, seed: int = 0, std: float | None = 0.02) -> None:
        """Random initialisation for a new checkpoint: N(0, std) projections, unit norms, mixer-specific rest.

        `std=None` keeps PyTorch's own initialisation of every Linear (uniform, +-1/sqrt(fan_in)) and Embedding
        (N(0, 1)). Small models train much better that way: at width 64 a 2-layer attention model stays on
        the "guess a not-yet-asked value" plateau of MQAR with N(0, 0.02) (GPT-2's choice for width 768+), and
        solves the task in ~1,000 steps with PyTorch's defaults and an untied LM head (training/train.py uses
        both; BENCHMARKS.md has the bisection).

        Two passes, so that a mixer's own init of its projections (e.g. SKA's orthogonal keys and zero W_o) is
        applied after, and not overwritten by, the generic init of every Linear (modules() visits a mixer before
        its child Linears).
        """
        torch.manual_seed(seed)
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                if std is None:
                    module.reset_parameters()
                else:
                    nn.init.normal_(module.weight, std=std)
                    if getattr(module, "bias", None) is not None:
                        nn.init.zeros_(module.bias)
        for module in self.modules():
            if isinstance(module, Mixer | KoopmanMLP):
                module.reset_parameters()

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: h `[..., hidden]` -> fp32 logits `[..., vocab]`."""
        h = self.norm(h)
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return (h @ weight.t()).float()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Training forward: input_ids `[B, T]` -> fp32 logits `[B, T, vocab]`, every sequence from a new state."""
        h = self.embed(input_ids).float()
        for layer in self.layers:
            h = layer(h)
        return self.logits(h)

    def prefill(
        self, input_ids: torch.Tensor, state: State, batch: PrefillBatch, all_logits: bool = False
    ) -> torch.Tensor:
        """Run a packed chunk of prompt tokens through the model, continuing each session's state.

        input_ids: `[T]` tokens of `batch`'s sessions, concatenated. Returns fp32 logits `[B, vocab]` for each
        session's last token, or `[T, vocab]` for every token when `all_logits`.
        """
        h = self.embed(input_ids).float()
        for layer, layer_state in zip(self.layers, state, strict=True):
            h = layer.prefill(h, layer_state, batch)
        if not all_logits:
            last = torch.tensor([end - 1 for _, end in batch.offsets], device=h.device)
            h = h.index_select(0, last)
        return self.logits(h)

    def decode(self, input_ids: torch.Tensor, state: State, slots: torch.Tensor) -> torch.Tensor:
        """One token per session: input_ids `[B]`, slots `[B]` -> fp32 logits `[B, vocab]`."""
        h = self.embed(input_ids).float()
        for layer, layer_state in zip(self.layers, state, strict=True):
            h = layer.decode(h, layer_state, slots)
        return self.logits(h)

"""HybridLM: embedding -> pre-norm residual blocks (mixer, optional MLP) -> final norm -> LM head."""

from __future__ import annotations

import torch
from torch import nn

from kvfree.engine.config import ModelConfig
from kvfree.engine.layers import Mixer, build_mixer
from kvfree.engine.layers.mlp import KoopmanMLP, build_mlp
from kvfree.engine.layers.norms import RMSNorm
from kvfree.engine.step_batch import StepBatch

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

    def serve(
        self, h: torch.Tensor, residual: torch.Tensor | None, state: dict[str, torch.Tensor], batch: StepBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The serving path of one block, on the pool: (h, residual) -> (h', residual').

        The same function as `forward` with the residual add folded into the next norm (one fused kernel on a GPU,
        as vLLM's `fused_add_rms_norm`): `residual` is the fp32 residual stream before `h` (this block's input
        delta, model dtype) is added to it; None before the first block, where `h` is the embedding.
        """
        normed, residual = self.norm.add_forward(h, residual)
        mix = self.mixer.decode if batch.is_decode else self.mixer.prefill
        h = mix(normed, state, batch)
        if self.mlp is not None:
            if isinstance(self.mlp_norm, RMSNorm):
                normed, residual = self.mlp_norm.add_forward(h, residual)
            else:  # the Koopman MLP's LayerNorm has no fused add
                residual = residual + h.float()
                normed = self.mlp_norm(residual)
            h = self.mlp(normed)
        return h, residual


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
        """Final norm and LM head: h `[..., hidden]` (the fp32 residual stream) -> fp32 logits `[..., vocab]`."""
        return self._lm_head(self.norm(h))

    def _lm_head(self, h: torch.Tensor) -> torch.Tensor:
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return (h @ weight.t()).float()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Training forward: input_ids `[B, T]` -> fp32 logits `[B, T, vocab]`, every sequence from a new state."""
        return self.logits(self.hidden_states(input_ids))

    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Training forward up to the final norm: input_ids `[B, T]` -> the fp32 residual stream `[B, T, hidden]`
        (`logits` of the rows that are scored is cheaper than the whole `[B, T, vocab]`)."""
        h = self.embed(input_ids).float()
        for layer in self.layers:
            h = layer(h)
        return h

    def prefill(
        self, input_ids: torch.Tensor, state: State, batch: StepBatch, all_logits: bool = False
    ) -> torch.Tensor:
        """Run a packed chunk of prompt tokens through the model, continuing each session's state.

        input_ids: `[T]` tokens of `batch`'s sessions, concatenated. Returns fp32 logits `[B, vocab]` for each
        session's last token, or `[T, vocab]` for every token when `all_logits`.
        """
        h, residual = self._serve(input_ids, state, batch)
        if not all_logits:
            last = batch.last_token_indices
            h, residual = h.index_select(0, last), residual.index_select(0, last)
        return self._head(h, residual)

    def decode(self, input_ids: torch.Tensor, state: State, batch: StepBatch) -> torch.Tensor:
        """One token per session of `batch`: input_ids `[B]` -> fp32 logits `[B, vocab]`."""
        return self._head(*self._serve(input_ids, state, batch))

    def _serve(self, input_ids: torch.Tensor, state: State, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.embed(input_ids), None
        for layer, layer_state in zip(self.layers, state, strict=True):
            h, residual = layer.serve(h, residual, layer_state, batch)
        return h, residual

    def _head(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The last residual add, the final norm and the LM head -> fp32 logits."""
        return self._lm_head(self.norm.add_forward(h, residual)[0])

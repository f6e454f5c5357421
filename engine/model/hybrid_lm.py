"""HybridLM: embedding -> pre-norm residual blocks (mixer, optional MLP) -> final norm -> LM head."""

from __future__ import annotations

import torch
from torch import nn

from kvfree.engine.model.config import ModelConfig
from kvfree.engine.model.layers import Mixer, build_mixer
from kvfree.engine.model.layers.attention import AttentionMixer
from kvfree.engine.model.layers.mlp import KoopmanMLP, build_mlp
from kvfree.engine.model.layers.norms import RMSNorm
from kvfree.engine.model.step_batch import StepBatch
from kvfree.engine.model.tensor_parallel import ONE_RANK, ROW, Split, TensorParallel, embed, lm_logits

State = list[dict[str, torch.Tensor]]  # per layer: name -> pool tensor [capacity, *shape]
# `--kv-cache-dtype`: the attention layers' KV cache dtype (None: the activation dtype).
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "fp8": torch.float8_e4m3fn}


def kv_cache_torch_dtype(name: str) -> torch.dtype | None:
    """The dtype of `--kv-cache-dtype name` (None: the activation dtype); ValueError naming the choices."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {name!r}: use one of {sorted(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[name]


class Block(nn.Module):
    """x = x + mixer(norm(x)); then, if the model has MLPs, x = x + mlp(mlp_norm(x)).

    The MLP kind picks its own pre-norm (`build_mlp`): RMSNorm for SwiGLU, LayerNorm for the Koopman MLP. Either
    way the tensors are `mlp_norm.*` and `mlp.*`, and the block (not the MLP) adds the residual.
    """

    def __init__(self, config: ModelConfig, kind: str, tp: TensorParallel = ONE_RANK, what: str = "") -> None:
        super().__init__()
        self.tp = tp
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mixer: Mixer = build_mixer(kind, config, tp, what)
        self.mlp_norm: nn.Module | None = None
        self.mlp: nn.Module | None = None
        if config.mlp is not None:
            mlp = config.mlp
            if tp.size > 1:  # a rank's block of the intermediate channels (the Koopman MLP's pairs stay whole)
                size = tp.block(mlp.intermediate_size, f"{what} mlp intermediate_size")
                if mlp.kind == "koopman" and (size.stop - size.start) % 2:
                    raise ValueError(f"{what} mlp intermediate_size: {mlp.intermediate_size} gives each of {tp.size} "
                                     "ranks an odd share, which would split a Koopman pair")  # fmt: skip
                mlp = mlp.model_copy(update={"intermediate_size": size.stop - size.start})
            self.mlp_norm, self.mlp = build_mlp(config.hidden_size, mlp, config.norm_eps)

    def weight_splits(self) -> dict[str, Split]:
        """Parameter name (within the block) -> how it divides among tensor-parallel ranks (`Mixer.weight_splits`)."""
        splits = {f"mixer.{name}": split for name, split in self.mixer.weight_splits().items()}
        if isinstance(self.mlp, KoopmanMLP):  # lift (and gate) column-, readout row-parallel; eigenvalues by pair
            splits.update({"mlp.lift.weight": Split(), "mlp.gate.weight": Split(), "mlp.gamma": Split(),
                           "mlp.omega": Split(), "mlp.readout.weight": ROW})  # fmt: skip
        elif self.mlp is not None:  # SwiGLU: gate and up column-, down row-parallel
            splits.update({"mlp.gate_proj.weight": Split(), "mlp.up_proj.weight": Split(), "mlp.down_proj.weight": ROW})
        return splits

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        if self.mlp is None:
            return x
        return x + self.tp.all_reduce(self.mlp(self.mlp_norm(x))).float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._mlp(x + self.tp.all_reduce(self.mixer(self.norm(x))).float())

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
        # Under tensor parallelism each rank's out projection gives a partial sum: one all-reduce completes it.
        h = self.tp.all_reduce(mix(normed, state, batch))
        if self.mlp is not None:
            if isinstance(self.mlp_norm, RMSNorm):
                normed, residual = self.mlp_norm.add_forward(h, residual)
            else:  # the Koopman MLP's LayerNorm has no fused add
                residual = residual + h.float()
                normed = self.mlp_norm(residual)
            h = self.tp.all_reduce(self.mlp(normed))
        return h, residual


class HybridLM(nn.Module):
    """A language model whose blocks mix tokens with the kinds listed in `config.layers`.

    The residual stream is kept in fp32 whatever the weight dtype (as HF's `residual_in_fp32`).

    With `tp` of N ranks this is one rank's part (docs/design/tensor-parallel.md): a block of every layer's heads and
    MLP channels, a block of the vocabulary in the embedding and the LM head; logits come back whole on every rank.
    Raises ValueError naming the layer when something does not divide among the ranks.
    """

    def __init__(self, config: ModelConfig, tp: TensorParallel = ONE_RANK) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        # A rank's block of the vocabulary: V / N rows, the last block padded with zero rows when N does not divide V.
        rows = -(-config.vocab_size // tp.size)
        self.embed = nn.Embedding(rows, config.hidden_size)
        self.layers = nn.ModuleList([Block(config, kind, tp, f"layers.{i} ({kind})")
                                     for i, kind in enumerate(config.layers)])  # fmt: skip
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, rows, False)

    def set_kv_cache_dtype(self, kv_cache_dtype: str) -> None:
        """Every attention layer's KV cache dtype: "auto" (the activation dtype) or "fp8" (e4m3, with a scale per
        session and KV head); call before a state pool is made (it reads the layers' state specs)."""
        dtype = kv_cache_torch_dtype(kv_cache_dtype)
        for layer in self.layers:
            if isinstance(layer.mixer, AttentionMixer):
                layer.mixer.kv_cache_dtype = dtype

    def weight_splits(self) -> dict[str, Split]:
        """Tensor name -> how the whole model's tensor divides among tensor-parallel ranks (absent: held whole)."""
        vocab = Split(length=self.config.vocab_size)
        splits = {"embed.weight": vocab, "lm_head.weight": vocab}
        for i, layer in enumerate(self.layers):
            splits.update({f"layers.{i}.{name}": split for name, split in layer.weight_splits().items()})
        return splits

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
        if self.tp.size == 1:
            return (h @ weight.t()).float()
        return lm_logits(h, weight, self.tp, self.config.vocab_size).float()  # (each rank's block, gathered)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids) if self.tp.size == 1 else embed(input_ids, self.embed.weight, self.tp)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Training forward: input_ids `[B, T]` -> fp32 logits `[B, T, vocab]`, every sequence from a new state."""
        return self.logits(self.hidden_states(input_ids))

    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Training forward up to the final norm: input_ids `[B, T]` -> the fp32 residual stream `[B, T, hidden]`
        (`logits` of the rows that are scored is cheaper than the whole `[B, T, vocab]`)."""
        h = self._embed(input_ids).float()
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

    def prefill_scored(
        self, input_ids: torch.Tensor, state: State, batch: StepBatch, rows: torch.Tensor, targets: torch.Tensor,
        top_k: int, rows_per_chunk: int = 512,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """`prefill`, also scoring prompt tokens: how likely each `targets[i]` was after the token at packed position
        `rows[i]` (the prompt's next token), for prompt logprobs.

        rows, targets: `[R]` int64 on the device. Returns the fp32 logits `[B, vocab]` of each session's last token,
        the log-probabilities `[R]` of the targets and their ranks `[R]` (1: the most likely token), and the `top_k`
        most likely tokens' ids and log-probabilities `[R, top_k]`. The LM head runs over `rows_per_chunk` rows at a
        time, so its memory is bounded whatever the chunk's length.
        """
        h, residual = self._serve(input_ids, state, batch)
        normed = self.norm.add_forward(h, residual)[0]
        last_logits = self._lm_head(normed.index_select(0, batch.last_token_indices))
        R = rows.shape[0]
        logprobs = torch.empty(R, dtype=torch.float32, device=h.device)
        ranks = torch.empty(R, dtype=torch.long, device=h.device)
        top_ids = torch.empty(R, top_k, dtype=torch.long, device=h.device)
        top_logprobs = torch.empty(R, top_k, dtype=torch.float32, device=h.device)
        for start in range(0, R, rows_per_chunk):
            part = slice(start, start + rows_per_chunk)
            lp = torch.log_softmax(self._lm_head(normed.index_select(0, rows[part])), dim=-1)
            logprobs[part] = target = lp.gather(1, targets[part, None])[:, 0]
            ranks[part] = (lp > target[:, None]).sum(dim=-1) + 1
            if top_k:
                top_logprobs[part], top_ids[part] = lp.topk(top_k, dim=-1)
        return last_logits, logprobs, ranks, top_ids, top_logprobs

    def decode(self, input_ids: torch.Tensor, state: State, batch: StepBatch) -> torch.Tensor:
        """One token per session of `batch`: input_ids `[B]` -> fp32 logits `[B, vocab]`."""
        return self._head(*self._serve(input_ids, state, batch))

    def _serve(self, input_ids: torch.Tensor, state: State, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self._embed(input_ids), None
        for layer, layer_state in zip(self.layers, state, strict=True):
            h, residual = layer.serve(h, residual, layer_state, batch)
        return h, residual

    def _head(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The last residual add, the final norm and the LM head -> fp32 logits."""
        return self._lm_head(self.norm.add_forward(h, residual)[0])

"""ModelRunner: feeds sequences through the model over the state pool and samples their next tokens.

Prefill runs eagerly (its shapes change every step); decode replays a captured CUDA graph on a GPU when every
mixer of the model can be captured (engine/cuda_graphs.py), and runs eagerly otherwise.
"""

from __future__ import annotations

import logging

import torch

from kvfree.engine.cuda_graphs import DecodeGraphs
from kvfree.engine.model import HybridLM
from kvfree.engine.sampling import SampleOutput, sample
from kvfree.engine.sequence import Sequence, TokenLogprob
from kvfree.engine.state_pool import StatePool
from kvfree.engine.step_batch import StepBatch

log = logging.getLogger("kvfree.engine")


class ModelRunner:
    """Owns the model and its StatePool; every method runs under inference mode on the model's device.

    Args:
        enforce_eager: never capture CUDA graphs (debugging, or to compare against the graphs).
    """

    def __init__(self, model: HybridLM, pool: StatePool, enforce_eager: bool = False) -> None:
        self.model = model
        self.pool = pool
        self.device = model.device
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and not enforce_eager:
            blockers = graph_blockers(model)
            if blockers:
                log.warning("decode runs eagerly (no CUDA graphs): %s", "; ".join(blockers))
            else:
                with torch.inference_mode():
                    self.graphs = DecodeGraphs(self._eager_decode, pool.capacity, pool.scratch_slot, self.device)
                log.info("captured CUDA graphs for decode batches of %s sessions", self.graphs.sizes)

    def _eager_decode(self, input_ids: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        return self.model.decode(input_ids, self.pool.tensors, batch)

    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence], chunks: list[list[int]], all_logits: bool = False) -> torch.Tensor:
        """Feed `chunks[i]` into `seqs[i]`'s state (one packed call). Returns logits `[B, V]` of each chunk's last
        token (`[T, V]` for every token with `all_logits`)."""
        ids = torch.tensor([t for chunk in chunks for t in chunk], dtype=torch.long, device=self.device)
        batch = StepBatch.prefill([s.slot for s in seqs], [len(c) for c in chunks], self.device)
        return self.model.prefill(ids, self.pool.tensors, batch, all_logits=all_logits)

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """Feed each sequence's last sampled token. Returns logits `[B, V]`."""
        ids = torch.tensor([s.output_token_ids[-1] for s in seqs], dtype=torch.long, device=self.device)
        slots = [s.slot for s in seqs]
        if self.graphs is not None and self.graphs.bucket(len(slots)) is not None:
            return self.graphs.replay(ids, slots)
        return self._eager_decode(ids, StepBatch.decode(slots, self.device))

    @torch.inference_mode()
    def sample(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Sample one token for each sequence from `logits` `[B, V]` and append it."""
        params = [s.params for s in seqs]
        counts = prompt_mask = None
        if any(p.uses_penalties for p in params):
            zeros = torch.zeros(logits.shape[-1], device=self.device)
            counts = torch.stack([s.counts if s.counts is not None else zeros for s in seqs])
            prompt_mask = torch.stack([s.prompt_mask if s.prompt_mask is not None else zeros.bool() for s in seqs])
        out = sample(logits, params, [s.generator for s in seqs], counts, prompt_mask)
        for row, (seq, token) in enumerate(zip(seqs, out.token_ids.tolist(), strict=True)):
            seq.append(token, self._logprob(out, row, seq))

    @staticmethod
    def _logprob(out: SampleOutput, row: int, seq: Sequence) -> TokenLogprob | None:
        k = seq.params.logprobs
        if k is None or out.logprobs is None:
            return None
        top = []
        if k > 0 and out.top_ids is not None:
            top = list(zip(out.top_ids[row, :k].tolist(), out.top_logprobs[row, :k].tolist(), strict=True))
        return TokenLogprob(int(out.token_ids[row]), float(out.logprobs[row]), top)


def graph_blockers(model: HybridLM) -> list[str]:
    """Why `model`'s decode step cannot be captured in a CUDA graph (empty when it can): one line per mixer kind."""
    seen: dict[str, str] = {}
    for layer in model.layers:
        mixer = layer.mixer
        if mixer.graph_blocker and mixer.kind not in seen:
            seen[mixer.kind] = f"{mixer.kind}: {mixer.graph_blocker}"
    return list(seen.values())

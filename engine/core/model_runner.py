"""ModelRunner: runs a ScheduledStep over the state pool and samples its tokens on the device.

On a GPU, decode replays a CUDA graph captured per batch bucket, and prefill one captured per (token, sequence)
bucket with the step padded to it, when every mixer of the model can be captured for that step
(engine/core/cuda_graphs.py,
each mixer's `graph_blocker` and `prefill_graph_blocker`); either runs eagerly otherwise. A decode row's input is
the token sampled for its slot by the previous step, kept on the device in `next_tokens`, so a step can be
launched before the previous one's tokens reach the host. Sampling replays a graph too, per batch bucket and the
kinds of sampling its rows ask for (engine/core/sampler_graphs.py). `launch` only queues device work; the handle it
returns waits for the one device-to-host copy of the step's sampled tokens.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvfree.engine.core.cuda_graphs import DecodeGraphs, PrefillGraphs
from kvfree.engine.core.sampler_graphs import SamplerGraphs
from kvfree.engine.core.sampling import BatchFlags, SampleOutput, SamplingTable
from kvfree.engine.core.scheduler import PromptScore, SampledTokens, ScheduledStep
from kvfree.engine.core.sequence import Sequence
from kvfree.engine.model.host_copy import upload, upload_tensor
from kvfree.engine.model.hybrid_lm import HybridLM
from kvfree.engine.model.step_batch import StepBatch
from kvfree.engine.protocol import TokenLogprob
from kvfree.engine.state.pool import StatePool
from kvfree.engine.text.grammar import fill_masks, mask_words

if TYPE_CHECKING:  # (a type only: the ranks sit above the runner and the pool)
    from kvfree.engine.parallel.ranks import Workers

log = logging.getLogger("kvfree.engine")


@dataclass
class StepHandle:
    """A launched step's sampled tokens, on their way to the host.

    ids: `[B]` int64 on the host (pinned, filled asynchronously on a GPU).  extra: `[B, 1 + 2k]` float64 on the
    host, the sampled token's logprob and the top-k (id, logprob) pairs for the batch's largest k, when some row
    asked for logprobs.  logprobs: each row's own `SamplingParams.logprobs` (None: none; k: its k alternatives).
    """

    ids: torch.Tensor | None
    extra: torch.Tensor | None
    logprobs: list[int | None]
    done: torch.cuda.Event | None
    scores: PromptScores | None = None

    def result(self) -> SampledTokens:
        """Wait for the copy (the step's one sync) and return the tokens as Python values."""
        if self.done is not None:
            self.done.synchronize()
        ids = self.ids.tolist() if self.ids is not None else []
        prompt = self.scores.entries() if self.scores is not None else []
        if self.extra is None:
            return SampledTokens(ids, [None] * len(ids), prompt)
        rows = zip(ids, self.extra.tolist(), self.logprobs, strict=True)
        logprobs = [None if k is None else _token_logprob(token, values, k) for token, values, k in rows]
        return SampledTokens(ids, logprobs, prompt)


@dataclass
class PromptScores:
    """A step's prompt logprobs on their way to the host: `values` `[R, 2 + 2k]` float64 (each scored row's target
    logprob and rank, then the step's largest k (id, logprob) pairs), and the step's `PromptScore`s that split
    them."""

    values: torch.Tensor
    scores: list[PromptScore]

    def entries(self) -> list[list[TokenLogprob]]:
        """Per score, a TokenLogprob per target token, with its own k alternatives (the rows are the scores' in
        order, each score's targets in turn)."""
        rows, out, at = self.values.tolist(), [], 0
        for score in self.scores:
            part = rows[at : at + len(score.targets)]
            at += len(score.targets)
            out.append([dataclasses.replace(_token_logprob(t, [v[0], *v[2:]], score.top_k), rank=int(v[1]))
                        for t, v in zip(score.targets, part, strict=True)])  # fmt: skip
        return out


@dataclass
class Forward:
    """What `ModelRunner.forward` queued: the logits `[len(step.sample), V]` of the rows to sample (None: none),
    and the step's prompt scores (None: none asked)."""

    logits: torch.Tensor | None
    scores: PromptScores | None = None


def _token_logprob(token_id: int, values: list[float], k: int) -> TokenLogprob:
    """One row of `StepHandle.extra` ([logprob, id_1, logprob_1, id_2, ...]) with its own k alternatives."""
    return TokenLogprob(token_id, values[0], [(int(values[1 + 2 * j]), values[2 + 2 * j]) for j in range(k)])


class ModelRunner:
    """Owns the model, its StatePool and the per-slot sampling table; everything runs under inference mode.

    Args:
        enforce_eager: never capture CUDA graphs (debugging, or to compare against the graphs).
        max_prefill_graph_tokens: the largest prefill step replayed from a CUDA graph; larger steps run eagerly.
            8,192, `LLM`'s default step: an eager step of that size still spends about as long launching its
            kernels as the GPU spends running them (24 ms of host work for 25 ms of device time, Mamba-2 370M on an
            H100), so the host, not the GPU, would set the pace of a long prompt.
    """

    def __init__(
        self, model: HybridLM, pool: StatePool, enforce_eager: bool = False, max_prefill_graph_tokens: int = 8192,
        workers: Workers | None = None,
    ) -> None:  # fmt: skip
        self.model = model
        self.pool = pool
        self.device = model.device
        self.workers = workers  # rank 0 under tensor parallelism: the other ranks run each step's model part too
        self.samples = model.tp.rank == 0  # (the other ranks never sample: rank 0 broadcasts the tokens)
        self.fingerprint: str | None = None  # the model's, when taken at start-up (tensor parallelism)
        rows = pool.capacity + 1  # the scratch slot too: padded graph rows read and write it
        self.next_tokens = torch.zeros(rows, dtype=torch.long, device=self.device)
        self.sampling = SamplingTable(rows, model.config.vocab_size, self.device)
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        self.sampler_graphs: SamplerGraphs | None = None
        if self.device.type == "cuda":
            self.warm_up_prefill()
        if self.device.type == "cuda" and not enforce_eager:
            blockers = graph_blockers(model)
            if blockers:
                log.warning("decode runs eagerly (no CUDA graphs): %s", "; ".join(blockers))
            else:
                with torch.inference_mode():
                    self.graphs = DecodeGraphs(self._decode_rows, pool.capacity, pool.scratch_slot, self.device)
                log.info("captured CUDA graphs for decode batches of %s sessions", self.graphs.sizes)
            if self.samples:
                self.sampler_graphs = SamplerGraphs(
                    self.sampling, self.next_tokens, model.config.vocab_size, pool.capacity, pool.scratch_slot
                )
                with torch.inference_mode():
                    count = self.sampler_graphs.capture_common()
                log.info("captured %d CUDA graphs for sampling batches of %s rows", count, self.sampler_graphs.sizes)
            blockers = graph_blockers(model, prefill=True)
            if blockers:
                log.info("prefill runs eagerly (no CUDA graphs): %s", "; ".join(blockers))
            else:  # captured lazily, a bucket on its first step
                self.prefill_graphs = PrefillGraphs(
                    self._prefill_rows, max_prefill_graph_tokens, pool.scratch_slot, self.device
                )

    @torch.inference_mode()
    def warm_up_prefill(self, tokens_per_sequence: int = 64) -> None:
        """Prefill 1, 2, 4, ... 32 short sequences into the scratch slot, so that Triton compiles and autotunes
        its prefill kernels for every batch shape they tune by (the number of sequences, in powers of two) at
        start-up rather than in the middle of the first requests (kernels/autotune.py). The prefill graphs' buckets
        of 2 to 64 sequences fall on the same autotuning keys (32 and more share one), so their lazy captures
        meet tuned kernels."""
        scratch = self.pool.scratch_slot
        tokens = min(tokens_per_sequence, self.pool.max_context)  # a KV cache must hold them
        for n in (1, 2, 4, 8, 16, 32):
            self.pool.reset(scratch)  # each warm-up starts from a new state (and an empty KV cache)
            ids = torch.zeros(n * tokens, dtype=torch.long, device=self.device)
            self.model.prefill(ids, self.pool.tensors, StepBatch.prefill([scratch] * n, [tokens] * n, self.device))
        self.pool.reset(scratch)
        torch.cuda.synchronize(self.device)

    def _prefill_rows(self, input_ids: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """The model's prefill over the pool -> logits `[B, V]` of each sequence's last token (what prefill graphs
        capture)."""
        return self.model.prefill(input_ids, self.pool.tensors, batch)

    def _decode_rows(self, batch: StepBatch) -> torch.Tensor:
        """Decode one token for each slot of `batch`, its input taken from `next_tokens` -> logits `[B, V]`.

        Under tensor parallelism rank 0's `next_tokens` (it samples) go to every rank first: a collective inside the
        step, so captured with it, and no host round trip."""
        input_ids = self.model.tp.broadcast_(self.next_tokens).index_select(0, batch.state_indices)
        return self.model.decode(input_ids, self.pool.tensors, batch)

    @torch.inference_mode()
    def launch(self, step: ScheduledStep) -> StepHandle:
        """Queue the step's device work: new rows' sampling setup, prefill, forks, decode, sampling, the copy of
        the sampled tokens to the host. Returns without waiting for the device."""
        return self.sample(step, self.forward(step))

    @torch.inference_mode()
    def forward(self, step: ScheduledStep) -> Forward:
        """Queue the model part of `launch`: new rows' sampling setup, prefill (scoring the prompt rows of
        `step.scores`), forks, decode. Returns the logits of the rows to sample, still being computed."""
        if step.admitted:
            seqs = step.admitted
            self.sampling.admit(
                [s.slot for s in seqs],
                [s.params for s in seqs],
                [s.seed for s in seqs],
                [s.prompt_token_ids for s in seqs],
            )
        decode_slots, prefill_slots = [s.slot for s in step.decode], [s.slot for s in step.prefill]
        scored = None  # the packed rows to score, their targets and the largest k: what every rank needs
        if step.scores:
            scored = ([s.row + i for s in step.scores for i in range(len(s.targets))],
                      [t for s in step.scores for t in s.targets], max(s.top_k for s in step.scores))  # fmt: skip
        if self.workers is not None:
            self.workers.send(("step", decode_slots, prefill_slots, step.chunks, step.forks, scored))
        decode_logits, prefill_logits, values = self.model_step(
            decode_slots, prefill_slots, step.chunks, step.forks, scored
        )
        scores = None
        if values is not None:
            scores = PromptScores(values.to("cpu", non_blocking=self.device.type == "cuda"), step.scores)
        logits = [decode_logits] if decode_logits is not None else []
        if prefill_logits is not None and step.sample_source:
            rows = upload(step.sample_source, torch.long, self.device)
            logits.append(prefill_logits.index_select(0, rows))
        if not step.sample:
            return Forward(None, scores)
        return Forward(torch.cat(logits) if len(logits) > 1 else logits[0], scores)

    def model_step(
        self, decode_slots: list[int], prefill_slots: list[int], chunks: list[list[int]], forks: list[tuple[int, int]],
        scored: tuple[list[int], list[int], int] | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
        """The model's part of a step, which every tensor-parallel rank runs: decode one token for each of
        `decode_slots`, then feed `chunks[i]` into `prefill_slots[i]` (scoring, with `scored` = (rows, targets, k),
        those packed rows on the prompt's next tokens) and make the step's forks (src, dst). Returns the decode
        logits `[len(decode_slots), V]`, the prefill's `[len(prefill_slots), V]` and the scores `[R, 2 + 2k]`
        (`PromptScores.values`; each None when there is no such part)."""
        self.pool.flush_resets()  # (a graph replay reads the pool's rows without going through `pool.tensors`)
        decode_logits = self._decode(decode_slots) if decode_slots else None
        prefill_logits = values = None
        if prefill_slots:
            if scored:
                prefill_logits, values = self._prefill_scored(prefill_slots, chunks, *scored)
            else:
                prefill_logits = self.prefill(prefill_slots, chunks)
            if forks:
                StatePool.copy_many(self.pool, forks)  # one launch for all; this rank's rows only (each rank runs this)
        return decode_logits, prefill_logits, values

    def _prefill_scored(
        self, slots: list[int], chunks: list[list[int]], rows: list[int], targets: list[int], k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """An eager prefill that also scores the packed `rows` on `targets` with their `k` most likely tokens
        (`HybridLM.prefill_scored`; under tensor parallelism every rank runs it, its LM head's collectives with it).
        Returns the last tokens' logits and the scores `[R, 2 + 2k]` on the device."""
        ids = upload([t for chunk in chunks for t in chunk], torch.long, self.device)
        batch = StepBatch.prefill(slots, [len(c) for c in chunks], self.device)
        logits, logprobs, ranks, top_ids, top_logprobs = self.model.prefill_scored(
            ids, self.pool.tensors, batch, upload(rows, torch.long, self.device),
            upload(targets, torch.long, self.device), k,
        )  # fmt: skip
        pairs = torch.stack([top_ids.double(), top_logprobs.double()], dim=-1).flatten(1)
        return logits, torch.cat([logprobs[:, None].double(), ranks[:, None].double(), pairs], dim=1)

    @torch.inference_mode()
    def sample(self, step: ScheduledStep, forward: Forward) -> StepHandle:
        """Queue the sampling part of `launch` over `forward`'s logits, and the copy of the tokens to the host.

        The grammar masks of constrained rows are computed here, on the host, from where their matchers stand now:
        a caller that has a constrained row's previous token still in flight reads it and advances the grammars
        between `forward` and this (engine/core/stepper.py), while the device runs the forward pass.
        """
        logits = forward.logits
        if logits is None:
            done = None
            if forward.scores is not None and self.device.type == "cuda":
                done = torch.cuda.Event()
                done.record()
            return StepHandle(None, None, [], done, forward.scores)
        slot_list = [s.slot for s in step.sample]
        params = [s.params for s in step.sample]
        flags = BatchFlags.of(params, self.model.config.vocab_size)
        constrained = [i for i, s in enumerate(step.sample) if s.matcher is not None and not s.finished]
        graphs = self.sampler_graphs
        if graphs is not None and graphs.serves(len(slot_list), flags):
            # A graph takes every row's mask, all bits set for the free ones.
            masks = self._host_masks(step.sample, constrained, every_row=True) if constrained else None
            out = graphs.replay(logits, slot_list, flags, masks)
            return self._to_host(out, [p.logprobs for p in params], forward.scores)
        allowed = None
        if constrained:
            masks = self._host_masks(step.sample, constrained, every_row=False)
            allowed = (upload(constrained, torch.long, self.device), upload_tensor(masks, self.device))
        slots = upload(slot_list, torch.long, self.device)
        out = self.sampling.sample(logits, slots, flags, params, allowed)
        self.next_tokens.index_copy_(0, slots, out.token_ids)
        return self._to_host(out, [p.logprobs for p in params], forward.scores)

    def _host_masks(self, seqs: list[Sequence], constrained: list[int], every_row: bool) -> torch.Tensor:
        """The grammar masks of the sequences `seqs[i]`, i in `constrained` (those that follow a grammar and have not
        finished: a finished one's token is dropped), as int32 bitmasks on the host, pinned on a GPU: one row per
        sequence of `seqs` with `every_row` (the free ones all bits set), else one per constrained sequence."""
        vocab = self.model.config.vocab_size
        rows = len(seqs) if every_row else len(constrained)
        out = torch.full((rows, mask_words(vocab)), -1, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        picked = [seqs[i] for i in constrained]
        fill_masks([s.matcher for s in picked], [s.end_tokens for s in picked], out,
                   constrained if every_row else list(range(len(constrained))))  # fmt: skip
        return out

    def _to_host(self, out: SampleOutput, logprobs: list[int | None], scores: PromptScores | None) -> StepHandle:
        on_gpu = self.device.type == "cuda"
        ids = out.token_ids.to("cpu", non_blocking=on_gpu)
        extra = None
        if out.logprobs is not None:
            parts = [out.logprobs[:, None].double()]
            if out.top_ids is not None:
                pairs = torch.stack([out.top_ids.double(), out.top_logprobs.double()], dim=-1)  # [B, k, 2]
                parts.append(pairs.flatten(1))
            extra = torch.cat(parts, dim=1).to("cpu", non_blocking=on_gpu)
        done = None
        if on_gpu:
            done = torch.cuda.Event()
            done.record()
        return StepHandle(ids, extra, logprobs, done, scores)

    def release_graphs(self) -> None:
        """Drop every CUDA graph, before the tensor-parallel group is torn down: a graph that captured collectives
        holds on to the NCCL communicator, whose teardown then waits for it (the runner decodes eagerly after)."""
        self.graphs = self.prefill_graphs = self.sampler_graphs = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def capture_prefill_graphs(self, max_tokens: int) -> None:
        """Capture now every prefill graph a step of up to `max_tokens` tokens replays (a server, before serving:
        a lazy capture would stall the streams of the step that meets it). Nothing to do without prefill graphs."""
        if self.workers is not None:
            self.workers.send(("capture_prefill", max_tokens))
        if self.prefill_graphs is None:
            return
        start = time.perf_counter()
        with torch.inference_mode():
            count = self.prefill_graphs.capture_up_to(max_tokens)
        if count:
            log.info("captured %d CUDA graphs for prefill steps of up to %d tokens in %.1f s", count,
                     min(max_tokens, self.prefill_graphs.token_sizes[-1]), time.perf_counter() - start)  # fmt: skip

    def replays_prefill(self, step: ScheduledStep) -> bool:
        """Whether `step`'s prefill will be a CUDA graph replay (a bucket already captured) rather than eager."""
        if self.prefill_graphs is None or not step.prefill:
            return False
        key = self.prefill_graphs.bucket(sum(map(len, step.chunks)), len(step.chunks))
        return key is not None and self.prefill_graphs.captured(key)

    @torch.inference_mode()
    def prefill(self, slots: list[int], chunks: list[list[int]], all_logits: bool = False) -> torch.Tensor:
        """Feed `chunks[i]` into slot `slots[i]` (one packed call). Returns logits `[B, V]` of each chunk's last
        token (`[T, V]` for every token with `all_logits`). Replays a prefill graph when one serves the step."""
        if self.prefill_graphs is not None and not all_logits:
            logits = self.prefill_graphs.replay(slots, chunks)
            if logits is not None:  # else no bucket holds the step: eager
                return logits
        ids = upload([t for chunk in chunks for t in chunk], torch.long, self.device)
        batch = StepBatch.prefill(slots, [len(c) for c in chunks], self.device)
        return self.model.prefill(ids, self.pool.tensors, batch, all_logits=all_logits)

    def _decode(self, slots: list[int]) -> torch.Tensor:
        if self.graphs is not None and self.graphs.bucket(len(slots)) is not None:
            return self.graphs.replay(slots)
        return self._decode_rows(StepBatch.decode(slots, self.device))


def graph_blockers(model: HybridLM, prefill: bool = False) -> list[str]:
    """Why `model`'s decode step (its prefill step with `prefill`) cannot be captured in a CUDA graph (empty when it
    can): one line per mixer kind."""
    seen: dict[str, str] = {}
    for layer in model.layers:
        mixer = layer.mixer
        blocker = mixer.prefill_graph_blocker if prefill else mixer.graph_blocker
        if blocker and mixer.kind not in seen:
            seen[mixer.kind] = f"{mixer.kind}: {blocker}"
    return list(seen.values())

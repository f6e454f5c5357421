"""The B'MOJO mixer (docs/design/bmojo.md): a Mamba-2 fading memory plus NoPE attention over a bounded key set.

Per token t (chunk start s = (t // w) * w), with P2 wiring (spec §3.1; u is the mixer input, already normed by the
block):

    y_t   = Mamba2(u)_t                                   fading memory (composed Mamba2Mixer)
    eps_t = mean((y_t - mean(y_{t-1..t-k}))^2)            innovation score (kernels/bmojo.innovation)
    a_t   = RMSNorm(u_t + y_t);  q, k, v = W_Q a, W_K a, W_V a
    o_t   = attn(q_t ; window(t) ∪ fading(s) ∪ eidetic(s))    memory rebuilt once per chunk (semantics C)
    out_t = y_t + W_O o_t                                 (the block adds the residual)

Fading tokens are W_K/W_V of RMSNorm(y_{s-m_f..s-1}); eidetic tokens are the K/V of the m_e positions p < s with the
largest eps. The engine's block hands the mixer only norm(h), so P2's "RMSNorm_2(h + y)" becomes RMSNorm(u + y) here:
the same layer up to the learned gain of the block norm (u = g * h / rms(h)).

P1 (literal Algorithm 1): y is not added to the output, q/k/v come from u, and fading tokens are RMSNorm(y).

Per-session state (fixed shapes, spec §3.8): the Mamba-2 `conv`/`ssm` states, `y_buf` (last max(k, m_f) outputs,
oldest first, fp32), a ring of the last w K/V (`ring_k`, `ring_v`, slot p % w) with their scores `ring_eps`, the
active fading K/V (`fad_k`, `fad_v`, valid count `fad_n`), the active eidetic store (`eid_k`, `eid_v`, `eid_eps`,
`eid_pos`, valid count `eid_n`) and the position `t`. The memory is published lazily: at the first token of a chunk
(t % w == 0, t > 0), from the ring, which then holds exactly the finished chunk. Zeros are a new session.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator
from torch import nn

from kvfree.engine.layers.base import Mixer, PrefillBatch, StateSpec
from kvfree.engine.layers.mamba2 import Mamba2Config, Mamba2Mixer
from kvfree.engine.layers.norms import RMSNorm
from kvfree.engine.strict_config import PositiveInt, StrictConfig
from kvfree.kernels.attention import attend
from kvfree.kernels.bmojo import chunked_memory_attention, eidetic_update, innovation

State = dict[str, torch.Tensor]


class BMojoConfig(StrictConfig):
    """B'MOJO fading + eidetic memory (docs/design/bmojo.md, chunked semantics C of §3.3).

    One layer = a Mamba-2 mixer (the fading memory, fields `ssm_*`) followed by NoPE attention whose keys are the
    last `window` tokens, `fading_tokens` SSM outputs before the current chunk and the `eidetic_tokens` past tokens
    with the largest innovation score. Memory is rebuilt once per chunk of `window` tokens.
    """

    num_heads: PositiveInt  # attention query heads
    head_dim: PositiveInt  # attention head width d_h
    ssm_num_heads: PositiveInt  # Mamba-2 heads H_s (d_inner = ssm_num_heads * ssm_head_dim)
    ssm_head_dim: PositiveInt  # Mamba-2 head width P
    num_kv_heads: PositiveInt | None = None  # GQA key/value heads; None = num_heads
    window: PositiveInt = 512  # w: sliding window AND chunk length (memory refresh period)
    fading_tokens: int = 1  # m_f: SSM outputs y_{s-m_f..s-1} before the chunk start s; 0 = no fading memory
    eidetic_tokens: int = 64  # m_e: capacity of the top-innovation store; 0 = B'MOJO-F
    predictor_taps: PositiveInt = 4  # k: fixed running-average predictor of y_t from y_{t-1..t-k}
    # "P2": SSM output joins the residual, attention reads norm(u + y); "P1": literal Algorithm 1
    wiring: Literal["P1", "P2"] = "P2"
    ssm_state_size: PositiveInt = 128  # N
    ssm_n_groups: PositiveInt = 1  # G (B/C groups)
    ssm_conv_kernel: PositiveInt = 4
    ssm_chunk_size: PositiveInt = 64  # SSD chunk length (numerics only, not semantics)
    ssm_time_step_limit: list[float] | None = None
    use_bias: bool = False
    norm_eps: float = Field(1e-5, gt=0)

    @model_validator(mode="after")
    def _check(self) -> BMojoConfig:
        if self.num_kv_heads is not None and self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads: {self.num_kv_heads} must divide num_heads ({self.num_heads})")
        # m_f, m_e <= w: at every chunk boundary the finished chunk alone can fill the store (bmojo.md §3.3), so
        # chunks >= 1 never have empty memory slots and the ring (w entries) holds every candidate at publish time.
        for name in ("fading_tokens", "eidetic_tokens"):
            value = getattr(self, name)
            if not 0 <= value <= self.window:
                raise ValueError(f"{name}: must be in [0, window={self.window}], got {value}")
        if self.ssm_num_heads % self.ssm_n_groups:
            raise ValueError(f"ssm_n_groups: {self.ssm_n_groups} must divide ssm_num_heads ({self.ssm_num_heads})")
        if self.ssm_time_step_limit is not None and len(self.ssm_time_step_limit) != 2:
            raise ValueError(f"ssm_time_step_limit: expected [min, max], got {self.ssm_time_step_limit}")
        return self

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    def mamba2_config(self) -> Mamba2Config:
        """The Mamba-2 sub-config of the fading-memory SSM."""
        return Mamba2Config(
            num_heads=self.ssm_num_heads,
            head_dim=self.ssm_head_dim,
            state_size=self.ssm_state_size,
            n_groups=self.ssm_n_groups,
            conv_kernel=self.ssm_conv_kernel,
            chunk_size=self.ssm_chunk_size,
            use_bias=self.use_bias,
            time_step_limit=self.ssm_time_step_limit,
            norm_eps=self.norm_eps,
        )


class BMojoMixer(Mixer):
    """Mamba-2 (fading memory) + innovation-selected eidetic memory + sliding window, one NoPE attention."""

    kind = "bmojo"
    config_class = BMojoConfig

    def __init__(self, hidden_size: int, cfg: BMojoConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.hidden_size = hidden_size
        self.w, self.m_f, self.m_e = cfg.window, cfg.fading_tokens, cfg.eidetic_tokens
        self.buf_len = max(cfg.predictor_taps, cfg.fading_tokens)
        # The fading memory is a whole Mamba-2 mixer, reused by composition (its own params, conv and SSM state).
        self.ssm = Mamba2Mixer(hidden_size, cfg.mamba2_config())
        Hq, Hkv, dh = cfg.num_heads, cfg.kv_heads, cfg.head_dim
        self.attn_norm = RMSNorm(hidden_size, cfg.norm_eps)
        self.q_proj = nn.Linear(hidden_size, Hq * dh, bias=cfg.use_bias)
        self.k_proj = nn.Linear(hidden_size, Hkv * dh, bias=cfg.use_bias)
        self.v_proj = nn.Linear(hidden_size, Hkv * dh, bias=cfg.use_bias)
        self.o_proj = nn.Linear(Hq * dh, hidden_size, bias=cfg.use_bias)

    def reset_parameters(self) -> None:
        self.ssm.reset_parameters()
        with torch.no_grad():
            self.attn_norm.weight.fill_(1.0)

    def state_specs(self, max_context: int) -> dict[str, StateSpec]:
        c = self.cfg
        Hkv, dh = c.kv_heads, c.head_dim
        i64, f32 = torch.int64, torch.float32
        specs = {
            "t": StateSpec((), dtype=i64),
            **self.ssm.state_specs(max_context),  # "conv" [K-1, conv_dim] (activation dtype), "ssm" [H, P, N] fp32
            "y_buf": StateSpec((self.buf_len, self.hidden_size), dtype=f32),
            "ring_k": StateSpec((self.w, Hkv, dh), dtype=None),
            "ring_v": StateSpec((self.w, Hkv, dh), dtype=None),
            "ring_eps": StateSpec((self.w,), dtype=f32),
            "fad_k": StateSpec((self.m_f, Hkv, dh), dtype=None),
            "fad_v": StateSpec((self.m_f, Hkv, dh), dtype=None),
            "fad_n": StateSpec((), dtype=i64),
            "eid_k": StateSpec((self.m_e, Hkv, dh), dtype=None),
            "eid_v": StateSpec((self.m_e, Hkv, dh), dtype=None),
            "eid_eps": StateSpec((self.m_e,), dtype=f32),
            "eid_pos": StateSpec((self.m_e,), dtype=i64),
            "eid_n": StateSpec((), dtype=i64),
        }
        return specs

    # -- shared pieces -----------------------------------------------------------------------------------------
    def _kv(self, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cfg
        return (
            self.k_proj(a).unflatten(-1, (c.kv_heads, c.head_dim)),
            self.v_proj(a).unflatten(-1, (c.kv_heads, c.head_dim)),
        )

    def _attn_input(self, u: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.attn_norm(u + y) if self.cfg.wiring == "P2" else u

    def _fading_kv(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Fading tokens: SSM outputs `[..., D]` through the attention pre-norm and the same W_K, W_V (spec §3.6)."""
        return self._kv(self.attn_norm(y.to(self.attn_norm.weight.dtype)))

    def _output(self, y: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        out = self.o_proj(o.flatten(-2))
        return y + out if self.cfg.wiring == "P2" else out

    def _fresh_state(self, batch: int, like: torch.Tensor) -> State:
        """A new session's state for `batch` sequences (the training path has no pool)."""
        return {
            name: torch.zeros((batch, *spec.shape), dtype=spec.dtype or like.dtype, device=like.device)
            for name, spec in self.state_specs(0).items()
        }

    # -- the chunked form (training forward and prefill) ---------------------------------------------------------
    def _run(self, u: torch.Tensor, st: State, t0: int) -> tuple[torch.Tensor, State]:
        """Sequences u `[B, T, D]` that all continue from position t0 with states `st` (`[B, ...]` each).

        Returns (output `[B, T, D]`, new state). Differentiable; the state inputs are only read.
        """
        B, T, _ = u.shape
        w, m_f, L = self.w, self.m_f, self.buf_len
        dev = u.device
        y, conv, ssm = self.ssm._mix(u, st["conv"], st["ssm"])
        eps, y_buf = innovation(y, st["y_buf"], self.cfg.predictor_taps)
        a = self._attn_input(u, y)
        q = self.q_proj(a).unflatten(-1, (self.cfg.num_heads, self.cfg.head_dim))
        k, v = self._kv(a)

        # The chunk grid: queries at positions s0 .. s0 + n*w - 1, keys at s0 - w .. s0 + n*w - 1. Keys before t0
        # come from the ring, which holds positions [t0 - w, t0); every real query t >= t0 only reaches keys
        # >= t - w + 1 > t0 - w, so the ring suffices and the zero fill elsewhere is never seen by a real query.
        s0 = (t0 // w) * w
        n = -(-(t0 + T - s0) // w)
        r0 = max(0, t0 - w)
        ring_slots = torch.arange(r0, t0, device=dev) % w
        pre = r0 - (s0 - w)
        post = (n + 1) * w - (t0 + T - (s0 - w))

        def ext(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
            pad = (B, 1, *new.shape[2:])
            return torch.cat(
                [new.new_zeros(pad).expand(B, pre, *new.shape[2:]), old[:, ring_slots].to(new.dtype), new]
                + [new.new_zeros(pad).expand(B, post, *new.shape[2:])],
                1,
            )

        k_ext, v_ext = ext(st["ring_k"], k), ext(st["ring_v"], v)
        eps_ext = ext(st["ring_eps"], eps)

        # Chunk boundaries inside this call publish a new memory (the lazy rule: the boundary at t0 itself is
        # published here too, since no token of that chunk has run yet). Fading tokens of all of them at once.
        starts = [s0 + i * w for i in range(n)]
        publish = [s > 0 and s >= t0 for s in starts]
        pub_starts = [s for s, p in zip(starts, publish, strict=True) if p]
        if pub_starts and m_f:
            y_ext = torch.cat([st["y_buf"].to(y.dtype), y], 1)  # position p at index L + p - t0
            rows = torch.tensor([L + s - t0 - m_f + i for s in pub_starts for i in range(m_f)], device=dev)
            fk, fv = self._fading_kv(y_ext[:, rows])
            fk = fk.unflatten(1, (len(pub_starts), m_f))
            fv = fv.unflatten(1, (len(pub_starts), m_f))
        fad_k, fad_v, fad_n = st["fad_k"], st["fad_v"], st["fad_n"]
        eid = (st["eid_k"], st["eid_v"], st["eid_eps"], st["eid_pos"], st["eid_n"])
        mem_k, mem_v, mem_valid = [], [], []
        fad_slots = torch.arange(m_f, device=dev)
        eid_slots = torch.arange(self.m_e, device=dev)
        pub_i = 0
        for i, s in enumerate(starts):
            if publish[i]:
                cand = slice(i * w, (i + 1) * w)  # chunk c-1 = positions s-w .. s-1 of the grid
                cand_pos = torch.arange(s - w, s, device=dev)
                eid = eidetic_update(*eid, k_ext[:, cand], v_ext[:, cand], eps_ext[:, cand].detach(), cand_pos)
                if m_f:
                    fad_k, fad_v = fk[:, pub_i].to(fad_k.dtype), fv[:, pub_i].to(fad_v.dtype)
                fad_n = torch.full_like(st["fad_n"], m_f)
                pub_i += 1
            mem_k.append(torch.cat([fad_k, eid[0]], 1))
            mem_v.append(torch.cat([fad_v, eid[1]], 1))
            mem_valid.append(torch.cat([fad_slots[None, :] < fad_n[:, None], eid_slots[None, :] < eid[4][:, None]], 1))

        q_grid = torch.cat(
            [q.new_zeros(B, t0 - s0, *q.shape[2:]), q, q.new_zeros(B, n * w - (t0 - s0) - T, *q.shape[2:])], 1
        )
        o = chunked_memory_attention(
            q_grid, k_ext, v_ext, torch.stack(mem_k, 1), torch.stack(mem_v, 1), torch.stack(mem_valid, 1), s0
        )[:, t0 - s0 : t0 - s0 + T]
        out = self._output(y, o)

        # Hand over: the ring keeps the last w positions; the memory stays that of the chunk of t0+T-1.
        keep = torch.arange(max(t0, t0 + T - w), t0 + T, device=dev)
        new = {
            "t": st["t"] + T,
            "conv": conv,
            "ssm": ssm,
            "y_buf": y_buf,
            "ring_k": st["ring_k"].index_copy(1, keep % w, k[:, keep - t0].to(st["ring_k"].dtype)),
            "ring_v": st["ring_v"].index_copy(1, keep % w, v[:, keep - t0].to(st["ring_v"].dtype)),
            "ring_eps": st["ring_eps"].index_copy(1, keep % w, eps[:, keep - t0]),
            "fad_k": fad_k,
            "fad_v": fad_v,
            "fad_n": fad_n,
            "eid_k": eid[0],
            "eid_v": eid[1],
            "eid_eps": eid[2],
            "eid_pos": eid[3],
            "eid_n": eid[4],
        }
        return out, new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x, self._fresh_state(x.shape[0], x), 0)[0]

    def prefill(self, x: torch.Tensor, state: State, batch: PrefillBatch) -> torch.Tensor:
        outs = []
        for i, (start, end) in enumerate(batch.offsets):
            if end == start:
                continue
            slot = batch.slots[i : i + 1]
            st = {name: tensor.index_select(0, slot) for name, tensor in state.items()}
            out, new = self._run(x[start:end].unsqueeze(0), st, int(st["t"][0]))
            for name, tensor in state.items():
                tensor.index_copy_(0, slot, new[name].to(tensor.dtype))
            outs.append(out[0])
        return torch.cat(outs) if outs else x[:0]

    # -- decode --------------------------------------------------------------------------------------------------
    def _publish_from_ring(self, state: State, slots: torch.Tensor, t: torch.Tensor) -> None:
        """Chunk-boundary publish (t % w == 0, t > 0) for `slots`: the ring holds positions t-w .. t-1 in order."""
        sel = {name: state[name].index_select(0, slots) for name in state}
        cand_pos = t[:, None] - self.w + torch.arange(self.w, device=t.device)[None, :]
        eid = eidetic_update(
            sel["eid_k"], sel["eid_v"], sel["eid_eps"], sel["eid_pos"], sel["eid_n"],
            sel["ring_k"], sel["ring_v"], sel["ring_eps"], cand_pos,
        )  # fmt: skip
        for name, value in zip(("eid_k", "eid_v", "eid_eps", "eid_pos", "eid_n"), eid, strict=True):
            state[name].index_copy_(0, slots, value.to(state[name].dtype))
        if self.m_f:
            fk, fv = self._fading_kv(sel["y_buf"][:, self.buf_len - self.m_f :])  # y_{t-m_f} .. y_{t-1}
            state["fad_k"].index_copy_(0, slots, fk.to(state["fad_k"].dtype))
            state["fad_v"].index_copy_(0, slots, fv.to(state["fad_v"].dtype))
        state["fad_n"].index_fill_(0, slots, self.m_f)

    def decode(self, x: torch.Tensor, state: State, slots: torch.Tensor) -> torch.Tensor:
        w = self.w
        t = state["t"].index_select(0, slots)  # [B] position of this token
        boundary = ((t > 0) & (t % w == 0)).nonzero().flatten()
        if boundary.numel():
            self._publish_from_ring(state, slots[boundary], t[boundary])
        y = self.ssm.decode(x, {"conv": state["conv"], "ssm": state["ssm"]}, slots)  # writes conv/ssm rows
        eps, y_buf = innovation(y[:, None], state["y_buf"].index_select(0, slots), self.cfg.predictor_taps)
        state["y_buf"].index_copy_(0, slots, y_buf)
        a = self._attn_input(x, y)
        q = self.q_proj(a).unflatten(-1, (self.cfg.num_heads, self.cfg.head_dim))
        k, v = self._kv(a)
        idx = t % w
        state["ring_k"][slots, idx] = k.to(state["ring_k"].dtype)
        state["ring_v"][slots, idx] = v.to(state["ring_v"].dtype)
        state["ring_eps"][slots, idx] = eps[:, 0]
        # NoPE: key order is irrelevant, so the ring is read in slot order; slots > t are unwritten at the start.
        keys = torch.cat([state[n].index_select(0, slots) for n in ("ring_k", "fad_k", "eid_k")], 1)
        values = torch.cat([state[n].index_select(0, slots) for n in ("ring_v", "fad_v", "eid_v")], 1)
        fad_n = state["fad_n"].index_select(0, slots)
        eid_n = state["eid_n"].index_select(0, slots)
        dev = x.device
        valid = torch.cat(
            [
                torch.arange(w, device=dev)[None, :] <= t[:, None],
                torch.arange(self.m_f, device=dev)[None, :] < fad_n[:, None],
                torch.arange(self.m_e, device=dev)[None, :] < eid_n[:, None],
            ],
            1,
        )
        o = attend(q[:, None], keys, values, valid[:, None, :])[:, 0]
        state["t"].index_add_(0, slots, torch.ones_like(t))
        return self._output(y, o)


def state_bytes(cfg: BMojoConfig, hidden_size: int, act_bytes: int) -> int:
    """Bytes of one session's state for one B'MOJO layer (spec §8), independent of the context length.

    2*Hkv*dh*(w + m_f + m_e)*b  (ring, fading, eidetic K/V)  + 4*(w + m_e) + 8*m_e  (ring/eidetic scores, positions)
    + 3*8  (t, fad_n, eid_n)  + 4*H_s*P*N  (SSM)  + b*(K-1)*(H_s*P + 2*G*N)  (conv tail)  + 4*max(k, m_f)*d  (y_buf)
    """
    c = cfg
    kv = 2 * c.kv_heads * c.head_dim * (c.window + c.fading_tokens + c.eidetic_tokens) * act_bytes
    scores = 4 * (c.window + c.eidetic_tokens) + 8 * c.eidetic_tokens + 3 * 8
    d_inner = c.ssm_num_heads * c.ssm_head_dim
    ssm = 4 * d_inner * c.ssm_state_size + act_bytes * (c.ssm_conv_kernel - 1) * (
        d_inner + 2 * c.ssm_n_groups * c.ssm_state_size
    )
    return kv + scores + ssm + 4 * max(c.predictor_taps, c.fading_tokens) * hidden_size

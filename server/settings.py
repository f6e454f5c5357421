"""ServerSettings: everything `kvfree serve` can be told, in one record."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class ServerSettings:
    """Limits and options of one server. The defaults suit a laptop; `kvfree serve --help` documents each flag."""

    model: Path | None = None  # checkpoint directory; None = the checkpoint shipped with kvfree
    served_model_name: str | None = None  # the `model` clients send; default: the checkpoint directory's name
    host: str = "127.0.0.1"
    port: int = 8000
    device: str = "auto"
    dtype: str = "auto"
    max_sessions: int | None = None  # state-pool slots: at most this many on a GPU (None: 1024), exactly on a CPU (64)
    gpu_memory_utilization: float | None = 0.9  # the share of the GPU's memory the pool is sized by (None: not)
    max_waiting: int = 256  # requests queued for a slot before 429
    max_batch_tokens: int = 2048  # tokens per engine step while sequences decode (decode + prefill chunks)
    max_prefill_tokens: int | None = None  # prefill tokens per step when nothing decodes (None: max_batch_tokens)
    prefill_batch_wait_ms: float = 50.0  # while sequences decode, how long a new prompt may wait to share a prefill
    max_prompt_tokens: int = 32768
    max_output_tokens: int = 4096
    max_context: int = 8192  # KV-cache size for models with full attention
    max_host_sessions: int = 1024  # idle sessions kept in host memory before spilling to snapshot_dir
    snapshot_dir: Path | None = None
    session_store: str | None = None  # redis://host:port/db, or a directory; replaces snapshot_dir
    session_write: str = "through"  # with session_store: "through", "async" (every turn) or "spill" (on eviction)
    session_ttl_seconds: float | None = None  # stored sessions unused this long expire (Redis)
    session_lease_seconds: float = 10.0  # a turn's claim on a session in a shared store, renewed while it runs
    prefix_cache: bool = True  # every request leaves checkpoints that later requests sharing its prefix resume from
    prefix_cache_bytes: int | None = None  # host memory the checkpoints may hold (None: a tenth of RAM, <= 8 GiB)
    replica_id: str | None = None  # the X-Kvfree-Replica response header; None: "hostname:port"
    snapshot_hmac_key: bytes | None = None
    api_keys_file: Path | None = None
    max_body_bytes: int = 64 * 1024 * 1024  # snapshots are uploaded whole
    shutdown_grace_seconds: float = 10.0
    cors_origins: list[str] = field(default_factory=list)  # CORS is off unless origins are given
    config_overrides: dict = field(default_factory=dict)
    enforce_eager: bool = False  # decode without CUDA graphs
    tensor_parallel_size: int = 1  # processes (GPUs) every layer's heads are split among
    kv_cache_dtype: str = "auto"  # "fp8": attention KV caches in e4m3 with per-session, per-KV-head scales
    engine_process: bool = True  # the engine core in a process of its own (False: on a thread of the HTTP process)

    @property
    def replica(self) -> str:
        """This replica's name in `X-Kvfree-Replica`: `replica_id`, else the hostname and port (two replicas on one
        host differ by their ports)."""
        return self.replica_id or f"{socket.gethostname()}:{self.port}"

"""Load generator and reports for kvfree servers (`kvfree loadtest`, or `python -m kvfree.loadtest`).

It speaks HTTP only (docs/design/architecture.md §1: nothing here imports the engine or the server), so it measures any
kvfree server by URL and the generic parts of any OpenAI-compatible one. Three scenarios, each bounded in count
and time:

- context sweep (`context_sweep`): one session per context length, prefilled with exactly L token ids, then a short
  decode continuing it; memory from `GET /v1/sessions/{id}` and `/metrics`, a least-squares memory slope per server;
- concurrency sweep (`concurrency_sweep`): 1..N concurrent streaming chat clients with seeded lognormal prompt and
  output lengths; TTFT, ITL, throughput, errors and 429s;
- session soak (`soak`): more sessions than the pool holds in multi-turn greedy chats, every turn compared with the
  same conversation sent without `session_id`, so offload and reload are verified, not just timed.

A second server (`--baseline-url`, e.g. the attention baseline) runs the same sweeps, and the report
(`report.json`, `report.md`, PNG plots) shows both side by side. Modules: `cli` (flags, exit status), `config`
(profiles), `runner` (the run), `client` (HTTP, SSE timing), `prom` (/metrics), `workload` (seeded requests),
`capacity` (sessions that fit in device memory), `stats`, `records`, `report`, `plots`, `progress`, `deadline`,
`target` (URL checks).
"""

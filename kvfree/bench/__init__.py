"""Every benchmark of kvfree, behind `kvfree bench <what>`: the model step, offline throughput, serving, sessions,
structured outputs, context, layers, stores, op host cost, KV-cache quality, and the per-op kernel scripts
(kvfree/bench/kernels/). They sit above the engine and the server and import them; nothing imports them."""

"""The state wing: the GPU pool of per-session recurrent state (and KV caches), a session's state packed into one
buffer, the mover between GPU and host, and snapshots (the file format of a session's state)."""

"""Load generator and memory/latency reports (not built yet)."""

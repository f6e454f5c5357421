"""The sessions wing: a session's record, the registry that owns them (`SessionManager`), where idle ones wait
(GPU, host memory, a store), the stores beyond this process, and the leases a shared store's turns hold."""

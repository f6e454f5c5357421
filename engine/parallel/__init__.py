"""The parallel wing: tensor parallelism's processes. Rank 0 starts the other ranks and sends them commands over
a shared-memory channel; every rank builds its part of the model, pool and runner the same way (`build_rank`)."""

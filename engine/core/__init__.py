"""The core wing: the step. Requests and their sequences, the scheduler that decides each step, the stepper that
schedules, runs and postprocesses it, the model runner and its CUDA graphs, and the batched sampler."""

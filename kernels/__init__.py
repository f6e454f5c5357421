"""The math of each mixer as functional ops: a pure-PyTorch reference per op, Triton kernels beside it later."""

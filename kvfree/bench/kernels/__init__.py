"""The device check scripts: each op's Triton kernels checked against its float64 reference and timed, on a GPU.

One script per op, each run as `python -m kvfree.bench.kernels.<op> --out DIR` or `python -m kvfree.bench.kernels
--op <op> --out DIR` (__main__.py; no --op is mamba2). Each writes DIR/<file>.json, prints a short table last and
exits 1 when a check fails; `--smoke` runs it with tiny sizes on the CPU under TRITON_INTERPRET=1
(tests/test_bench_scripts.py). kvfree/bench/kernels/gpu_run.sh runs them all on a device, into docs/bench/.

    mamba2.py     Mamba-2 (SSD) and the short causal conv: checks at real sizes, decode against the state floor, the
                  chunked prefill, fla's simple-GLA kernels as anchors (kernels.json)
    gka.py        Gated KalmaNet: checks, decode, prefill, fla's MesaNet kernels as anchors (gka.json)
    lattice.py    Lattice at lattice-110m's sizes: checks, decode against the floor, prefill (lattice.json)
    ska.py        SKA at echo-180m's sizes: checks, decode, prefill, fp32 against fp64 accumulators (ska.json)
    bmojo.py      B'MOJO's memory at bmojo-1.4b's sizes: checks, decode against the floor, prefill (bmojo.json)
    norm.py       the RMS norms (plain, add, gated): checks and GB/s against a copy (norm.json; no --op)
    gdn.py        Gated DeltaNet at hmf's 8B shape: checks, decode against the floor (BV sweep), the chunked prefill,
                  fla's gated-delta-rule kernels as anchors (gdn.json)
    attention.py  the attention prefill (chunk_attention) at attention-370m's and an 8B shape: checks, tokens/s against
                  PyTorch's flash attention at the same shape, the reference op, attention-370m end to end
                  (attention.json)

The timing helpers they share, and their frame (`CheckScript`: command line, sizes, steps, result), are
kvfree.bench.harness (the engine's benchmarks use it too); their shared checks, timing loops and table pieces,
and the steps of the slot-pool ops (gdn, gka), are kvfree/bench/kernels/common.py.
"""

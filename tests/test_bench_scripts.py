"""The device benchmark scripts still run: each in its `--smoke` mode (tiny sizes, Triton interpreted on the CPU),
checking its kernels and writing its JSON, so a change that breaks a script is caught before a device call."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")


SMOKE_SCRIPTS = [
    ("kvfree.bench.kernels", "kernels.json"),
    ("kvfree.bench.kernels.norm", "norm.json"),
    ("kvfree.bench.kernels.gka", "gka.json"),
    ("kvfree.bench.kernels.bmojo", "bmojo.json"),
    ("kvfree.bench.kernels.lattice", "lattice.json"),
    ("kvfree.bench.kernels.lattice_train", "lattice_train.json"),
    ("kvfree.bench.kernels.ska", "ska.json"),
    ("kvfree.bench.kernels.gdn", "gdn.json"),
    ("kvfree.bench.kernels.attention", "attention.json"),
    ("kvfree.bench.kernels.attention_decode", "attention_decode.json"),
    ("kvfree.bench.kernels.bmojo_f", "bmojo_f.json"),
]
AT_ONCE = 2  # scripts run side by side (each is one interpreted, single-threaded process): the machine's cores


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """Every script's `--smoke` run, AT_ONCE at a time: module -> (its finished process, its output folder)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    runs, queue = {}, list(SMOKE_SCRIPTS)
    running: list[tuple[str, subprocess.Popen, Path]] = []
    while queue or running:
        while queue and len(running) < AT_ONCE:
            module, _ = queue.pop(0)
            out = tmp_path_factory.mktemp(module.rsplit(".", 1)[-1])
            with open(out / "log.txt", "w") as log:  # (a file, not a pipe: a full pipe would stall the script)
                proc = subprocess.Popen([sys.executable, "-m", module, "--smoke", "--out", str(out)], env=env,
                                        cwd=out, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
            running.append((module, proc, out))
        module, proc, out = running.pop(0)
        proc.wait(timeout=300)
        log = (out / "log.txt").read_text(errors="replace")
        runs[module] = (subprocess.CompletedProcess(proc.args, proc.returncode, log, ""), out)
    return runs


@pytest.mark.skipif(torch.cuda.is_available(), reason="--smoke is the CPU mode; on a GPU run the real scripts")
@pytest.mark.parametrize(("module", "out_file"), SMOKE_SCRIPTS)
def test_kernel_bench_script_smoke(smoke_runs, module, out_file):
    result, out = smoke_runs[module]
    assert result.returncode == 0, result.stdout[-6000:]
    report = json.loads((out / out_file).read_text())
    assert report["checks"] and not report["errors"]
    assert all(check["ok"] for check in report["checks"].values())


def test_model_bench_script_on_the_cpu(tmp_path):
    from kvfree.bench.step import main

    out = tmp_path / "model.json"
    assert (
        main(["--preset", "tiny", "--device", "cpu", "--batch", "1", "3", "--prefill-tokens", "64", "--out", str(out)])
        == 0
    )
    report = json.loads(out.read_text())
    assert [row["batch"] for row in report["decode"]] == [1, 3]
    assert report["prefill"]["tokens"] == 64 and report["prefill"]["tokens_per_s"] > 0
    assert report["cuda_graphs"] is False and report["environment"]["torch"] == torch.__version__


def test_model_bench_times_a_prompt_longer_than_half_the_kv_cache(tmp_path):
    """A model with a KV cache: the prefill is timed over and over on one slot sized for the prompt (it overflowed on
    the second call: `--preset attention-370m --prefill-tokens 16384` failed on an H200)."""
    from kvfree.bench.step import main

    out = tmp_path / "model.json"
    args = ["--preset", "tiny-attention", "--device", "cpu", "--batch", "1", "--prefill-tokens", "96"]
    assert main([*args, "--out", str(out)]) == 0
    assert json.loads(out.read_text())["prefill"]["tokens"] == 96


def test_offline_bench_on_the_cpu(tmp_path):
    from kvfree.bench.step import main

    out = tmp_path / "offline.json"
    args = ["--offline", "--preset", "tiny", "--device", "cpu", "--prompts", "3", "--prompt-tokens", "40"]
    assert main([*args, "--max-tokens", "6", "--max-batch-tokens", "64", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    many, one = report["runs"]
    assert (many["prompts"], one["prompts"]) == (3, 1)
    assert many["output_tokens"] == 18 and one["output_tokens"] == 6
    assert many["output_tokens_per_s"] > 0 and many["prefill_steps"] >= 2  # 120 prompt tokens in 64-token steps
    assert report["overlap"] is False and report["profile"] is None  # nothing to overlap or profile on a CPU


def test_layer_bench_smoke(tmp_path):
    """`python -m kvfree.bench.layers --smoke`: a preset's layer built, decoded and prefilled on the CPU, and
    its JSON written (the timings themselves mean nothing here)."""
    out = tmp_path / "layer.json"
    result = subprocess.run(
        [sys.executable, "-m", "kvfree.bench.layers", "--preset", "tiny-lattice", "--smoke", "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["kind"] == "lattice" and set(report["decode"]) == {"B1", "B3"} and report["prefill"]["2x16"]["ms"] > 0

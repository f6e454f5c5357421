"""The `kvfree` command line: in-process through `kvfree.cli.main` and once as a real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kvfree.checkpoints import CONFIG_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, WEIGHTS_FILE, default_checkpoint_path
from kvfree.cli import main
from kvfree.engine import LLM, SamplingParams
from kvfree.engine.model.loader import load_model
from kvfree.engine.model.presets import init_checkpoint, preset_config
from kvfree.engine.text.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def default_greedy() -> str:
    """What the embedded checkpoint writes after "Hello" greedily in 8 tokens."""
    return LLM(device="cpu").generate("Hello", SamplingParams(temperature=0, max_tokens=8))[0].text


def test_generate_in_process(capsys, default_greedy):
    assert main(["generate", "Hello", "--max-tokens", "8", "--temperature", "0", "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("Hello")
    assert out == "Hello" + default_greedy + "\n"
    assert "tokens/s" in err
    prompt_tokens = len(Tokenizer(default_checkpoint_path()).encode("Hello"))
    assert f"prompt {prompt_tokens} tokens" in err and "device=cpu" in err


def test_generate_repetition_penalty(capsys, tmp_path):
    ckpt = init_checkpoint("tiny", tmp_path / "tiny", seed=1)
    argv = ["generate", "abc", "-m", str(ckpt), "--max-tokens", "12", "--temperature", "0"]
    assert main([*argv, "--repetition-penalty", "1.5"]) == 0
    out = capsys.readouterr().out
    params = SamplingParams(temperature=0, repetition_penalty=1.5, max_tokens=12)
    assert out == "abc" + LLM(ckpt, device="cpu").generate("abc", params)[0].text + "\n"


def test_generate_stop_string_in_process(capsys, default_greedy):
    stop = next(
        (
            default_greedy[i : i + 2]
            for i in range(1, len(default_greedy) - 1)
            if "\ufffd" not in default_greedy[i : i + 2]
        ),
        None,
    )
    if stop is None:
        pytest.skip(f"no stop string candidate in {default_greedy!r}")
    argv = ["generate", "Hello", "--max-tokens", "8", "--temperature", "0", "--stop", stop, "--device", "cpu"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert out == "Hello" + default_greedy[: default_greedy.index(stop)] + "\n"
    assert "finish_reason=stop" in err


def test_generate_seeded_sampling_is_reproducible(capsys, tmp_path):
    ckpt = init_checkpoint("tiny", tmp_path / "tiny", seed=1)
    argv = ["generate", "abc", "-m", str(ckpt), "--max-tokens", "12", "--temperature", "1.0", "--seed", "9"]
    assert main([*argv, "--top-k", "20"]) == 0
    first = capsys.readouterr().out
    assert main([*argv, "--top-k", "20"]) == 0
    assert capsys.readouterr().out == first
    expect = LLM(ckpt, device="cpu").generate(
        "abc", SamplingParams(temperature=1.0, top_p=0.95, top_k=20, seed=9, max_tokens=12)
    )
    assert first == "abc" + expect[0].text + "\n"


def test_generate_chat_wraps_prompt_in_template(capsys):
    assert main(["generate", "Hi", "--chat", "--max-tokens", "4", "--temperature", "0", "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    llm = LLM(device="cpu")
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert "Hi" in prompt and prompt != "Hi"
    expect = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4))[0]
    assert out == expect.text + "\n"  # the chat prompt itself is not echoed
    assert f"prompt {len(expect.prompt_token_ids)} tokens" in err


def test_generate_subprocess(default_greedy):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "kvfree", "generate", "Hello", "--max-tokens", "8", "--temperature", "0"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Hello")
    assert proc.stdout == "Hello" + default_greedy + "\n"
    assert "tokens/s" in proc.stderr
    assert "finish_reason=" in proc.stderr


def test_init_checkpoint_writes_a_loadable_checkpoint(capsys, tmp_path):
    out_dir = tmp_path / "made"
    assert main(["init-checkpoint", "tiny", str(out_dir)]) == 0
    assert str(out_dir) in capsys.readouterr().out
    assert {p.name for p in out_dir.iterdir()} == {CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE, TOKENIZER_CONFIG_FILE}
    model = load_model(out_dir, device="cpu")
    assert model.config == preset_config("tiny")
    # Same as the library call with the CLI's default seed (0); another seed gives other weights.
    ref = load_file(init_checkpoint("tiny", tmp_path / "ref", seed=0) / WEIGHTS_FILE)
    made = load_file(out_dir / WEIGHTS_FILE)
    assert set(made) == set(ref) and all(torch.equal(made[k], ref[k]) for k in ref)
    assert main(["init-checkpoint", "tiny", str(tmp_path / "s1"), "--seed", "1"]) == 0
    other = load_file(tmp_path / "s1" / WEIGHTS_FILE)
    assert not all(torch.equal(other[k], ref[k]) for k in ref)


def test_init_checkpoint_bfloat16(tmp_path):
    assert main(["init-checkpoint", "tiny-hybrid", str(tmp_path / "bf"), "--dtype", "bfloat16"]) == 0
    tensors = load_file(tmp_path / "bf" / WEIGHTS_FILE)
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert load_model(tmp_path / "bf", device="cpu").config == preset_config("tiny-hybrid")


def test_init_checkpoint_unknown_preset_exits_2(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["init-checkpoint", "enormous", str(tmp_path / "x")])
    assert e.value.code == 2
    assert "enormous" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_init_checkpoint_bad_dtype_returns_2(capsys, tmp_path):
    assert main(["init-checkpoint", "tiny", str(tmp_path / "x"), "--dtype", "float8"]) == 2
    assert "float8" in capsys.readouterr().err


def test_generate_nonexistent_model_returns_2(capsys):
    assert main(["generate", "Hello", "--model", "/nonexistent/ckpt", "--max-tokens", "2"]) == 2
    out, err = capsys.readouterr()
    assert "/nonexistent/ckpt" in err
    assert "error" in err


def test_generate_bad_temperature_returns_2(capsys):
    assert main(["generate", "Hello", "--temperature", "-1", "--max-tokens", "2", "--device", "cpu"]) == 2
    out, err = capsys.readouterr()
    assert "temperature" in err
    assert "Hello" not in out


def test_generate_damaged_checkpoint_returns_2_naming_tensor(capsys, tmp_path):
    from safetensors.torch import save_file

    ckpt = init_checkpoint("tiny", tmp_path / "tiny", seed=2)
    tensors = load_file(ckpt / WEIGHTS_FILE)
    del tensors["norm.weight"]
    save_file(tensors, ckpt / WEIGHTS_FILE)
    assert main(["generate", "Hi", "-m", str(ckpt), "--max-tokens", "2"]) == 2
    assert "'norm.weight'" in capsys.readouterr().err


def test_missing_subcommand_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2


NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


@pytest.mark.parametrize(
    "device", ["tpu9", "meta", pytest.param("cuda", marks=NO_CUDA), pytest.param("cuda:3", marks=NO_CUDA)]
)
def test_generate_bad_device_returns_2(capsys, device):
    """A device this machine cannot use is a clean error (exit 2 naming it), not a traceback."""
    assert main(["generate", "Hi", "--device", device, "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert repr(device) in err and "error" in err


def test_set_overrides_config_values(capsys) -> None:
    from kvfree.cli import main
    from kvfree.engine.model.config import parse_overrides

    assert parse_overrides(["mamba2.chunk_size=16", "notes.x=abc"]) == {"mamba2.chunk_size": 16, "notes.x": "abc"}
    assert main(["generate", "Hi", "--max-tokens", "3", "--temperature", "0", "--set", "mamba2.chunk_size=16"]) == 0
    assert main(["generate", "Hi", "--set", "mamba2.chunk_size=0"]) == 2
    assert "mamba2.chunk_size" in capsys.readouterr().err
    assert main(["generate", "Hi", "--set", "nosuch.key=1"]) == 2
    assert "nosuch" in capsys.readouterr().err
    assert main(["generate", "Hi", "--set", "oops"]) == 2


def test_enforce_eager_flag_is_accepted_by_generate_and_serve(capsys, default_greedy) -> None:
    """`--enforce-eager` is accepted by generate and serve; on the CPU (never graphed) the tokens are unchanged."""
    args = ["generate", "Hello", "--max-tokens", "8", "--temperature", "0", "--device", "cpu", "--enforce-eager"]
    assert main(args) == 0
    assert capsys.readouterr().out == "Hello" + default_greedy + "\n"
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "--enforce-eager" in capsys.readouterr().out


def test_bench_subcommand_writes_its_json(capsys, tmp_path) -> None:
    out = tmp_path / "b.json"
    args = ["bench", "--preset", "tiny", "--device", "cpu", "--batch", "2", "--prefill-tokens", "16", "--out", str(out)]
    assert main(args) == 0
    assert "prefill of 16 tokens" in capsys.readouterr().out
    assert json.loads(out.read_text())["decode"][0]["batch"] == 2


def test_serve_with_a_checkpoint_the_engine_cannot_load_says_why_in_one_line(tmp_path):
    """The engine loads the checkpoint in its own process; its error reaches the command line as the usual one-line
    `kvfree serve: error: ...` and exit status 2, not a traceback."""
    result = subprocess.run(
        [sys.executable, "-m", "kvfree", "serve", str(tmp_path / "missing"), "--device", "cpu"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "kvfree serve: error:" in result.stderr and "no such checkpoint directory" in result.stderr
    assert "Traceback" not in result.stderr


def test_bench_names_every_benchmark_and_takes_the_old_flags(capsys):
    from kvfree.bench.cli import BENCHMARKS, choose

    assert main(["bench", "--help"]) == 0
    listed = capsys.readouterr().out
    assert all(f"  {name} " in listed for name in BENCHMARKS)
    assert choose(["serve", "CKPT", "--clients", "1"]) == ("serve", ["CKPT", "--clients", "1"])
    assert choose(["--serve", "CKPT"]) == ("serve", ["--serve", "CKPT"])  # the spelling from before the subcommands
    assert choose(["--sessions", "CKPT"])[0] == "sessions" and choose(["--structured"])[0] == "structured"
    assert choose(["--preset", "tiny"]) == ("step", ["--preset", "tiny"])
    assert main(["bench", "no-such-bench"]) == 2
    assert "unknown benchmark 'no-such-bench'" in capsys.readouterr().err

"""How far an fp8 KV cache moves a model's answers: logits and greedy choices against the unquantized cache.

The same model and prompts run twice, each in its own state pool: with the KV cache in the activation dtype (bf16 on
a GPU, fp32 on the CPU) and with `--kv-cache-dtype fp8`. Each prompt is prefilled, then decoded greedily for some
steps by the unquantized run; the fp8 run is fed the same tokens (teacher forcing), so every step compares the two
caches on one history. Reported per model: the relative error of each step's logits (median and max over steps and
prompts), the share of steps whose greedy token agrees, and the largest change of the chosen token's
log-probability. The prefill's own logits are equal by construction (a chunk's own keys are not read back from the
cache), so only decode steps are counted.

    python -m kvfree.bench.kv_cache_quality --checkpoint DIR [DIR ...]     # converted checkpoints (hmf's fixtures)
    python -m kvfree.bench.kv_cache_quality --hmf-8b-gka --prompt-tokens 4096   # random weights, on a GPU
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import torch

from kvfree.bench.harness import environment, write_json
from kvfree.engine.model.hybrid_lm import HybridLM
from kvfree.engine.model.loader import load_model, resolve_device
from kvfree.engine.model.step_batch import StepBatch
from kvfree.engine.state.pool import StatePool


@torch.inference_mode()
def compare(model: HybridLM, prompts: int, prompt_tokens: int, steps: int, seed: int = 0) -> dict[str, Any]:
    """The fp8 cache against the unquantized one on `prompts` random prompts of `prompt_tokens` tokens and `steps`
    decode steps each (all prompts batched); returns the figures of the module docstring."""
    device = model.device
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (prompts * prompt_tokens,), generator=gen).to(device)
    pools = {}
    for kv in ("auto", "fp8"):
        model.set_kv_cache_dtype(kv)
        pools[kv] = StatePool(model, prompts, max_context=prompt_tokens + steps + 1)
    slots = list(range(prompts))
    for pool in pools.values():
        for _ in slots:
            pool.alloc()
    logits = {kv: [] for kv in pools}
    prefill = StepBatch.prefill(slots, [prompt_tokens] * prompts, device)
    decode = StepBatch.decode(slots, device)
    for kv, pool in pools.items():
        first = model.prefill(ids, pool.tensors, prefill).argmax(-1)  # (equal in both: see the module docstring)
        if kv == "auto":
            tokens = first
    for _ in range(steps):
        exact = model.decode(tokens, pools["auto"].tensors, decode).float()
        quant = model.decode(tokens, pools["fp8"].tensors, decode).float()
        logits["auto"].append(exact)
        logits["fp8"].append(quant)
        tokens = exact.argmax(-1)  # both runs continue from the unquantized run's choice
    model.set_kv_cache_dtype("auto")
    exact, quant = torch.stack(logits["auto"]), torch.stack(logits["fp8"])  # [steps, prompts, V]
    errors = ((quant - exact).norm(dim=-1) / exact.norm(dim=-1)).flatten().tolist()
    chosen = exact.argmax(-1, keepdim=True)
    logprob_change = (quant.log_softmax(-1).gather(-1, chosen) - exact.log_softmax(-1).gather(-1, chosen)).abs()
    return {
        "prompts": prompts,
        "prompt_tokens": prompt_tokens,
        "decode_steps": steps,
        "logit_rel_error_median": statistics.median(errors),
        "logit_rel_error_max": max(errors),
        "greedy_agreement": float((quant.argmax(-1) == exact.argmax(-1)).float().mean()),
        "chosen_logprob_change_max": float(logprob_change.max()),
        "kv_bytes_per_token": {kv: pool.bytes_per_token() for kv, pool in pools.items()},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvfree.bench.kv_cache_quality", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", type=Path, nargs="+", help="kvfree checkpoint directories")
    src.add_argument("--hmf-8b-gka", action="store_true", help="random weights in hmf's GKA Qwen3-8B shape (GPU)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=32, help="decode steps compared per prompt")
    ap.add_argument("--out", type=Path, default=Path("docs/bench/kv-fp8-quality.json"))
    args = ap.parse_args(argv)
    device = resolve_device(args.device)
    rows = []
    if args.hmf_8b_gka:
        from kvfree.bench.context import HMF_QWEN3_8B_GKA, random_model
        from kvfree.checkpoints.hf_hmf import convert_config
        from kvfree.engine.model.config import ModelConfig

        config = ModelConfig.from_dict(convert_config(HMF_QWEN3_8B_GKA, Path("hmf-qwen3-8b-gka")))
        models = [("hmf GKA-primed Qwen3-8B shape, random weights", lambda: random_model(config, device,
                                                                                          torch.bfloat16))]  # fmt: skip
    else:
        models = [(path.name, lambda path=path: load_model(path, device=device)) for path in args.checkpoint]
    for name, build in models:
        model = build()
        row = {"model": name, "dtype": str(model.dtype).removeprefix("torch.")}
        row.update(compare(model, args.prompts, args.prompt_tokens, args.steps))
        rows.append(row)
        del model
    write_json(args.out, {"what": "fp8 KV cache against the unquantized cache, teacher-forced greedy decode",
                          "env": environment(device), "rows": rows})  # fmt: skip
    print(f"{'model':<48} {'dtype':>8} {'rel err med':>11} {'max':>8} {'greedy agree':>12} {'dlogp max':>9}")
    for r in rows:
        print(f"{r['model'][-48:]:<48} {r['dtype']:>8} {r['logit_rel_error_median']:>11.4f} "
              f"{r['logit_rel_error_max']:>8.4f} {r['greedy_agreement']:>12.1%} {r['chosen_logprob_change_max']:>9.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

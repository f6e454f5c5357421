"""The `kvfree-demo` training command (training/demo.py) end to end on the CPU, with a tiny random teacher.

A two-layer Llama made with transformers and saved with kvfree's byte tokenizer stands in for SmolLM2: the command
labels the data with it, writes the student's tokenizer, primes and distils the student, saves its state in shards,
resumes from them, and writes a checkpoint that kvfree loads and serves from.
"""

from __future__ import annotations

import json

import pytest
import torch

from kvfree.checkpoints.byte_tokenizer import write_byte_tokenizer
from kvfree.engine.loader import load_model
from kvfree.engine.model import HybridLM
from kvfree.engine.tokenizer import Tokenizer
from kvfree.training import demo

transformers = pytest.importorskip("transformers")

ARGS = ["--hidden", "64", "--layers", "4", "--n-train", "24", "--n-eval", "6", "--teacher-batch", "8",
        "--max-new-tokens", "8", "--max-len", "768", "--batch-tokens", "2048", "--warmup", "2", "--save-every", "2",
        "--log-every", "1", "--device", "cpu"]  # fmt: skip


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A random two-layer Llama over kvfree's byte vocabulary, saved as a Hugging Face model folder."""
    path = tmp_path_factory.mktemp("teacher")
    vocab = write_byte_tokenizer(path)
    with torch.inference_mode(False):
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096,
        )  # fmt: skip
        transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def test_student_fits_the_wheel_budget():
    """Both students at their defaults and SmolLM2's 49,152-token vocabulary stay under 60 MB in bf16, and every
    layer's state is bounded (no per-token state)."""
    for family in demo.FAMILIES:
        config = demo.student_config(49152, 2, family)
        model = HybridLM(config)
        assert 2 * sum(p.numel() for p in model.parameters()) <= 60e6, family
        assert ("ska" in config.layers) == (family == "echo")
        assert not any(spec.per_token for layer in model.layers for spec in layer.mixer.state_specs(1024).values())


def test_priming_keeps_the_teachers_token_geometry():
    """The primed embedding is the teacher's projected on its top principal directions: nearest neighbours agree."""
    g = torch.Generator().manual_seed(1)
    low = torch.randn(300, 8, generator=g)
    teacher = low @ torch.randn(8, 96, generator=g) + 0.01 * torch.randn(300, 96, generator=g)  # rank ~8
    student = HybridLM(demo.student_config(300, 2, "mamba2", hidden=64, layers=2))
    demo.prime_embedding(student, teacher)
    emb = student.embed.weight.detach()
    t = torch.nn.functional.normalize(teacher - teacher.mean(0), dim=-1)
    s = torch.nn.functional.normalize(emb, dim=-1)
    t_nn = (t @ t.T).fill_diagonal_(-2).argmax(-1)
    s_nn = (s @ s.T).fill_diagonal_(-2).argmax(-1)
    assert (t_nn == s_nn).float().mean() > 0.95
    with pytest.raises(ValueError, match="cannot prime"):
        demo.prime_embedding(student, teacher[:, :32])


def test_state_shards_round_trip(tmp_path, monkeypatch):
    """The resumable state splits into shards under the size limit and restores model and optimizer exactly."""
    with torch.inference_mode(False):
        model = HybridLM(demo.student_config(300, 2, "echo", hidden=64, layers=4))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randint(0, 300, (2, 9))).square().mean().backward()
        opt.step()
        monkeypatch.setattr(demo, "SHARD_BYTES", 100_000)
        demo.save_state(tmp_path, model, opt, {"step": 7, "position": 28, "log": []})
        shards = sorted(tmp_path.glob("shard-*.safetensors"))
        assert len(shards) > 2 and all(f.stat().st_size < 2 * 100_000 + 8192 for f in shards)
        fresh = HybridLM(demo.student_config(300, 2, "echo", hidden=64, layers=4))
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
        meta = demo.load_state(tmp_path, fresh, fresh_opt)
    assert meta["step"] == 7 and meta["position"] == 28
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    for i, state in opt.state_dict()["state"].items():
        assert all(torch.equal(v, fresh_opt.state_dict()["state"][i][k]) for k, v in state.items())
    (tmp_path / "meta.json").unlink()  # an interrupted save: no state at all
    assert demo.load_state(tmp_path, fresh, fresh_opt) is None


def test_teacher_logits_are_taken_at_the_scored_positions_only(teacher):
    """`teacher_scored_logits` runs the LM head on the scored rows: the same logits as the full forward there."""
    model = transformers.AutoModelForCausalLM.from_pretrained(teacher).eval()
    ids = torch.randint(0, 200, (2, 7))
    labels = ids.clone()
    labels[0, :4] = demo.IGNORE
    labels[1, 5:] = demo.IGNORE
    with torch.no_grad():
        full = model(ids).logits[:, :-1][labels[:, 1:] != demo.IGNORE]
    got = demo.teacher_scored_logits(model, ids, labels)
    assert got.shape == (7, model.config.vocab_size) and torch.allclose(got, full, atol=1e-5)


def test_distill_loss_is_cross_entropy_plus_kl_on_reply_tokens():
    g = torch.Generator().manual_seed(2)
    s, t = torch.randn(2, 5, 11, generator=g), torch.randn(2, 5, 11, generator=g)
    labels = torch.tensor([[demo.IGNORE, demo.IGNORE, 3, 4, 5], [demo.IGNORE, 1, 2, demo.IGNORE, demo.IGNORE]])
    loss, parts = demo.distill_loss(s, t[:, :-1][labels[:, 1:] != demo.IGNORE], labels, kl_weight=0.5)
    scored = [(0, 1, 3), (0, 2, 4), (0, 3, 5), (1, 0, 1), (1, 1, 2)]  # (row, position, next token)
    ce = sum(-torch.log_softmax(s[b, p], -1)[y] for b, p, y in scored) / len(scored)
    kl = sum(torch.sum(torch.softmax(t[b, p], -1) * (torch.log_softmax(t[b, p], -1) - torch.log_softmax(s[b, p], -1)))
             for b, p, _ in scored) / len(scored)  # fmt: skip
    assert torch.allclose(loss, ce + 0.5 * kl, rtol=1e-5)
    assert parts["ce"] == pytest.approx(ce.item(), rel=1e-5) and parts["kl"] == pytest.approx(kl.item(), rel=1e-5)


def test_training_command_labels_distils_resumes_and_writes_a_servable_checkpoint(teacher, tmp_path):
    out = tmp_path / "run"
    with torch.inference_mode(False):
        assert demo.main(["--teacher", str(teacher), "--out", str(out), "--steps", "3", *ARGS]) == 0
        first = json.loads((out / "report.json").read_text())
        data_mtime = (out / "data" / "train.jsonl").stat().st_mtime_ns
        assert demo.main(["--teacher", str(teacher), "--out", str(out), "--steps", "6", *ARGS]) == 0
    report = json.loads((out / "report.json").read_text())
    assert first["step"] == 3 and report["step"] == 6 and report["done"]
    assert (out / "data" / "train.jsonl").stat().st_mtime_ns == data_mtime  # the data is made once
    steps = [row["step"] for row in report["log"]]
    assert steps == [1, 2, 3, 4, 5, 6]  # the second run continued the first one's log and count
    assert all(row["loss"] == row["loss"] and row["kl"] >= 0 for row in report["log"])  # finite, KL term on
    rows = [json.loads(line) for line in (out / "data" / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 24 and {r["skill"] for r in rows} == {"chat", "tools", "recall", "text"}
    assert {r["source"] for r in rows if r["skill"] in ("chat", "text")} == {"teacher"}
    loss = report["held_out_loss"]
    assert loss["student"] > 0 and loss["teacher"] > 0

    model = load_model(out / "checkpoint", device="cpu")
    assert model.config.layers == ["mamba2", "mamba2", "mamba2", "ska"]
    tok = Tokenizer(out / "checkpoint")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=tools)
    assert "<tool_call>" in prompt and prompt.endswith("<|im_start|>assistant\n")
    assert tok.decode(tok.encode(prompt), skip_special_tokens=False) == prompt

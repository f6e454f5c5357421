"""The `kvfree-demo` training command (training/demo.py): its encoding, batches and loss, and the command end to end on
the CPU with a tiny random teacher.

Examples are encoded as the server renders them and labelled on every target turn; batches are made from their step
alone, within their token budget, with long recall conversations whose length grows with the curriculum, the
teacher's rows flagged for the KL term, and values that are often whole words of the tokenizer's vocabulary (a tiny
byte-level BPE trained here has some); the loss is cross-entropy plus KL computed by hand. A two-layer Llama made
with transformers and saved with kvfree's byte tokenizer stands in for SmolLM2: the command labels the data with it,
writes the students' tokenizer, primes and distils both students on the same batches, saves their states in shards,
resumes from them, and writes checkpoints that kvfree loads and serves from, and `--init` starts a student from one.

The files' many small ops run on one intra-op thread (`one_thread`): on a loaded 2-core machine two threads waiting on
each other made a training step 10-100x slower.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import statistics

import pytest
import torch

from kvfree.checkpoints.byte_tokenizer import CHAT_TEMPLATE, EOS, SPECIAL_TOKENS, write_byte_tokenizer
from kvfree.engine.model.hybrid_lm import HybridLM
from kvfree.engine.model.loader import load_model
from kvfree.engine.text.tokenizer import Tokenizer
from kvfree.training import demo
from kvfree.training.demo_data import (
    EVAL_VALUES,
    SKILLS,
    call_text,
    examples,
    recall_example,
    target_reply,
    tool_turn,
)
from tests.paths import TINY_CHECKPOINT

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

ARGS = ["--hidden", "64", "--layers", "4", "--n-train", "16", "--n-eval", "6", "--teacher-batch", "8",
        "--max-new-tokens", "8", "--max-len", "1024", "--batch-tokens", "2048", "--warmup", "2", "--save-every", "2",
        "--log-every", "1", "--workers", "0", "--device", "cpu"]  # fmt: skip


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


def test_student_logits_are_taken_at_the_scored_positions_only():
    """`scored_logits` (the LM head on the scored rows of `hidden_states`) equals the full forward's logits there."""
    torch.manual_seed(0)
    model = HybridLM(demo.student_config(300, 2, "echo", hidden=64, layers=4)).eval()
    ids = torch.randint(0, 300, (2, 9))
    labels = ids.clone()
    labels[0, :5] = demo.IGNORE
    labels[1, 7:] = demo.IGNORE
    got = demo.scored_logits(model, ids, labels)
    assert got.shape == (4 + 6, 300)  # labels 5..8 of the first row, 1..6 of the second
    assert torch.allclose(got, model(ids)[:, :-1][labels[:, 1:] != demo.IGNORE], atol=1e-5)


def _spans(ids: list[int], labels: list[int]) -> list[list[int]]:
    """The runs of labelled tokens, each checked to be labelled with its own id."""
    spans: list[list[int]] = []
    for i, (x, y) in enumerate(zip(ids, labels, strict=True)):
        if y != demo.IGNORE:
            assert y == x
            if i == 0 or labels[i - 1] == demo.IGNORE:
                spans.append([])
            spans[-1].append(x)
    return spans


def _row(ex, reply=None):
    return {"skill": ex.skill, "messages": ex.messages, "tools": ex.tools, "reply": reply or target_reply(ex)}


def test_encoding_labels_exactly_the_target_turns_and_the_reply():
    """A call carried on to its result, a recall conversation of several questions and a chat request with tools:
    the ids are the whole rendered conversation's, and the labelled spans are the target turns (the call, earlier
    answers) and the final reply, each with its end token; a text row is labelled throughout; an example longer
    than `max_len` is left out."""
    tok = Tokenizer(TINY_CHECKPOINT)
    turn = tool_turn(random.Random(0), "train")
    recall = next(ex for seed in range(20) if len((ex := recall_example(random.Random(seed), "train", 2, 3))
                                                   .target_turns) == 2)  # fmt: skip
    chat = next(ex for ex in examples("train", 0, 40, skills=("chat",)) if ex.tools)
    cases = [
        (turn, None, [call_text(turn.messages[2]["tool_calls"][0]["function"]), turn.answer]),
        (recall, None, [recall.messages[i]["content"] for i in recall.target_turns] + [recall.answer]),
        (chat, "A reply in words.", ["A reply in words."]),
    ]
    for ex, reply, targets in cases:
        row = _row(ex, reply)
        ids, labels = demo.encode_example(tok, row, 100_000)
        whole = tok.apply_chat_template([*ex.messages, {"role": "assistant", "content": row["reply"]}],
                                        add_generation_prompt=False, tools=ex.tools)  # fmt: skip
        assert ids == tok.encode(whole.removesuffix("\n")), ex.skill
        decoded = [tok.decode(span, skip_special_tokens=False) for span in _spans(ids, labels)]
        assert decoded == [t + "<|im_end|>" for t in targets], ex.skill
        assert demo.encode_example(tok, row, len(ids)) is not None
        assert demo.encode_example(tok, row, len(ids) - 1) is None
    text = {"skill": "text", "messages": [{"role": "user", "content": "Once upon a time a fox"}], "tools": None,
            "reply": " ran home."}  # fmt: skip
    ids, labels = demo.encode_example(tok, text, 100)
    assert ids == labels == tok.encode("Once upon a time a fox ran home.")
    assert demo.encode_example(tok, text, len(ids) - 1) is None


def test_rows_are_read_at_newlines_only(tmp_path):
    """A reply holding characters `splitlines` breaks at (U+2028, U+0085, a form feed) reads back whole."""
    rows = [{"reply": "one\u2028two\x85three\x0cfour"}, {"reply": "next"}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    assert demo.read_rows(path) == rows


POOL = [
    {"skill": "chat", "messages": [{"role": "user", "content": "Write a haiku about rain."}], "tools": None,
     "reply": "Soft rain on the roof.", "source": "teacher"},
    {"skill": "chat", "messages": [{"role": "user", "content": "What is the capital of Peru?"}], "tools": None,
     "reply": "Lima is the capital of Peru.", "source": "teacher"},
    {"skill": "text", "messages": [{"role": "user", "content": "Once upon a time a fox"}], "tools": None,
     "reply": " ran into the woods and found a river.", "source": "teacher"},
    {"skill": "text", "messages": [{"role": "user", "content": "Every morning, the baker"}], "tools": None,
     "reply": " lit the oven before dawn.", "source": "teacher"},
]  # fmt: skip


def _maker(**kw) -> demo.BatchMaker:
    pad = Tokenizer(TINY_CHECKPOINT).eos_token_id
    return demo.BatchMaker(TINY_CHECKPOINT, POOL, kw.pop("seed", 0), kw.pop("batch_tokens", 4096),
                           kw.pop("max_len", 2048), pad, **kw)  # fmt: skip


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in ("ids", "labels", "from_teacher")) and a["tokens"] == b["tokens"]


def test_batches_are_made_from_their_step_alone():
    """A fresh maker and one that has made other batches (its encoding cache filled) give batch `(step, steps)` the
    same; another step or seed gives another batch."""
    used = _maker()
    made = [used[(step, 100)] for step in range(6)]
    fresh = _maker()
    assert _same(fresh[(4, 100)], made[4]) and _same(fresh[(1, 100)], made[1])
    assert not _same(made[4], made[5]) and not _same(_maker(seed=1)[(4, 100)], made[4])


def test_batches_keep_their_budget_and_flag_the_teachers_rows():
    """Every batch stays within `batch_tokens` padded tokens; `from_teacher` is set exactly on the rows that are the
    pool's chat and text (found by their tokens), and the scored tokens by skill add up to the labels of each kind;
    mixed batches draw every skill, and some hold the teacher's rows beside made-up ones."""
    tok = Tokenizer(TINY_CHECKPOINT)
    maker = _maker(long_share=0.0)
    pooled = {tuple(e[0]): e for e in (demo.encode_example(tok, r, 2048) for r in POOL)}
    skills, mixed = set(), 0
    for step in range(10):
        batch = maker[(step, 100)]
        ids, labels, from_teacher = batch["ids"], batch["labels"], batch["from_teacher"]
        assert ids.numel() <= 4096 and from_teacher.dtype == torch.bool and len(from_teacher) == len(ids)
        counted = {True: 0, False: 0}
        for row, row_labels, flag in zip(ids, labels, from_teacher.tolist(), strict=True):
            content = row[row != maker.pad_id].tolist()
            assert flag == (tuple(content) in pooled)
            if flag:
                assert row_labels[: len(content)].tolist() == pooled[tuple(content)][1]
            counted[flag] += int((row_labels != demo.IGNORE).sum())
        tokens = batch["tokens"]
        assert counted[True] == tokens.get("chat", 0) + tokens.get("text", 0)
        assert counted[False] == tokens.get("tools", 0) + tokens.get("recall", 0)
        skills |= set(tokens)
        mixed += 0 < int(from_teacher.sum()) < len(from_teacher)
    assert skills == set(SKILLS) and mixed > 0


def test_long_recall_batches_grow_with_the_curriculum():
    """The cap grows from 512 tokens to `max_len` over the first half of the run; about a quarter of the batches are
    long recall conversations (made up, never the teacher's), the others mixed ones, each batch the one a maker of
    only that kind makes at its step; at the same steps long ones are longer when the cap is `max_len` than when it
    is near 512."""
    maker = _maker()
    assert [maker.recall_cap(s, 100) for s in (0, 25, 50, 100)] == [512, 512 + (2048 - 512) // 2, 2048, 2048]
    assert all(maker.recall_cap(s, 100) <= maker.recall_cap(s + 1, 100) for s in range(100))
    # Makers of one kind draw what the default one draws after its first draw (long or not).
    long_only, mixed_only = _maker(long_share=1.0), _maker(long_share=0.0)
    long_steps = []
    for s in range(32):
        batch = maker[(s, 100)]
        if set(batch["tokens"]) == {"recall"} and _same(batch, long_only[(s, 100)]):
            assert not batch["from_teacher"].any(), s
            long_steps.append(s)
        else:
            assert _same(batch, mixed_only[(s, 100)]), s
    assert 3 <= len(long_steps) <= 16  # about a quarter (4 of these 32)

    def lengths(steps: int) -> list[int]:
        rows = [long_only[(s, steps)]["ids"] for s in range(1, 9)]
        return [int(n) for ids in rows for n in (ids != long_only.pad_id).sum(1)]

    early, late = lengths(1000), lengths(2)  # cap about 512, then 2048
    assert statistics.mean(late) > 1.3 * statistics.mean(early) and max(late) > max(early)
    assert max(late) <= 2048


def test_distill_loss_is_cross_entropy_plus_kl_on_the_teachers_rows():
    """Cross-entropy of the known replies' positions plus that of the teacher's, plus kl_weight x KL(teacher ||
    student) on the teacher's positions, each a mean over its positions; a term is left out without its rows."""
    g = torch.Generator().manual_seed(2)
    logits, t_all = torch.randn(9, 11, generator=g), torch.randn(9, 11, generator=g)
    targets = torch.randint(0, 11, (9,), generator=g)
    from_teacher = torch.tensor([0, 1, 1, 0, 0, 1, 0, 1, 1], dtype=torch.bool)
    known, taught = (~from_teacher).nonzero().squeeze(1).tolist(), from_teacher.nonzero().squeeze(1).tolist()

    def ce(rows):
        return sum(-torch.log_softmax(logits[i], -1)[targets[i]] for i in rows) / len(rows)

    def kl(rows):
        return sum(torch.sum(torch.softmax(t_all[i], -1) * (torch.log_softmax(t_all[i], -1)
                                                            - torch.log_softmax(logits[i], -1)))
                   for i in rows) / len(rows)  # fmt: skip

    loss, parts = demo.distill_loss(logits, targets, from_teacher, t_all[from_teacher], kl_weight=0.5)
    assert torch.allclose(loss, ce(known) + ce(taught) + 0.5 * kl(taught), rtol=1e-5)
    assert parts == pytest.approx({"ce_known": ce(known).item(), "ce_teacher": ce(taught).item(),
                                   "kl": kl(taught).item()}, rel=1e-5)  # fmt: skip

    none = torch.zeros(9, dtype=torch.bool)
    loss, parts = demo.distill_loss(logits, targets, none, None, kl_weight=0.5)
    assert set(parts) == {"ce_known"} and torch.allclose(loss, ce(range(9)), rtol=1e-5)
    every = torch.ones(9, dtype=torch.bool)
    loss, parts = demo.distill_loss(logits, targets, every, t_all, kl_weight=2.0)
    assert set(parts) == {"ce_teacher", "kl"} and torch.allclose(loss, ce(range(9)) + 2 * kl(range(9)), rtol=1e-5)
    loss, parts = demo.distill_loss(logits, targets, from_teacher, None, kl_weight=0.5)  # no teacher logits: no KL
    assert set(parts) == {"ce_known", "ce_teacher"} and torch.allclose(loss, ce(known) + ce(taught), rtol=1e-5)
    loss, parts = demo.distill_loss(logits, targets, from_teacher, t_all[from_teacher], kl_weight=0.0)
    assert "kl" not in parts and torch.allclose(loss, ce(known) + ce(taught), rtol=1e-5)


@pytest.fixture(scope="module")
def trained(teacher, tmp_path_factory):
    """The training command on the tiny teacher, 3 steps then resumed to 6: (its folder, the first call's reports,
    the data's modification time after the first call)."""
    out = tmp_path_factory.mktemp("trained") / "run"
    with torch.inference_mode(False):
        assert demo.main(["--teacher", str(teacher), "--out", str(out), "--steps", "3", *ARGS]) == 0
        first = {f: json.loads((out / f / "report.json").read_text()) for f in demo.FAMILIES}
        data_mtime = (out / "data" / "train.jsonl").stat().st_mtime_ns
        assert demo.main(["--teacher", str(teacher), "--out", str(out), "--steps", "6", *ARGS]) == 0
    return out, first, data_mtime


def test_training_command_labels_distils_resumes_and_writes_servable_checkpoints(trained):
    """Both students trained in one run on the same batches; a second call with more steps resumes both (their logs
    and step counts continue) and keeps the data made once: the teacher's chat and text for training, every skill
    for evaluation. The logged loss is its parts' sum; both checkpoints load and serve the tool template."""
    out, first, data_mtime = trained
    reports = {f: json.loads((out / f / "report.json").read_text()) for f in demo.FAMILIES}
    assert (out / "data" / "train.jsonl").stat().st_mtime_ns == data_mtime  # the data is made once
    for family, report in reports.items():
        assert first[family]["step"] == 3 and report["step"] == 6 and report["done"] and report["family"] == family
        assert [row["step"] for row in report["log"]] == [1, 2, 3, 4, 5, 6]  # continued the first run's log
        assert json.loads((out / family / "state" / "meta.json").read_text())["step"] == 6
        for row in report["log"]:
            parts = row.get("ce_known", 0) + row.get("ce_teacher", 0) + row.get("kl", 0)
            assert math.isfinite(row["loss"]) and row["loss"] == pytest.approx(parts, rel=1e-4)
            assert row.get("kl", 0) >= 0 and ("kl" in row) == ("ce_teacher" in row)
        assert any("kl" in row for row in report["log"]) and any("ce_known" in row for row in report["log"])
        loss = report["held_out_loss"]
        assert loss["student"] > 0 and loss["teacher"] > 0 and report["held_out_examples"] > 0
    echo, twin = reports["echo"]["log"], reports["mamba2"]["log"]
    assert [r["tokens"] for r in echo] == [r["tokens"] for r in twin]  # the same batches
    assert [r["loss"] for r in echo] != [r["loss"] for r in twin]  # two models

    train = demo.read_rows(out / "data" / "train.jsonl")
    cases = examples("train", 0, 16, ("chat", "text"))
    assert [r["messages"] for r in train] == [ex.messages for ex in cases]
    assert {r["skill"] for r in train} == {"chat", "text"} and {r["source"] for r in train} == {"teacher"}
    held = demo.read_rows(out / "data" / "eval.jsonl")
    assert {r["skill"] for r in held} == set(SKILLS) and len(held) == 6
    for row, ex in zip(held, examples("eval", 0, 6), strict=True):
        assert row["messages"] == ex.messages
        known = target_reply(ex)
        if known is None:
            assert row["source"] == "teacher" and isinstance(row["reply"], str)
        else:
            assert row["source"] == "known" and row["reply"] == known

    for family, layers in (("echo", ["mamba2", "mamba2", "mamba2", "ska"]), ("mamba2", ["mamba2"] * 4)):
        model = load_model(out / family / "checkpoint", device="cpu")
        assert model.config.layers == layers
        tok = Tokenizer(out / family / "checkpoint")
        tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
        prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=tools)
        assert "<tool_call>" in prompt and prompt.endswith("<|im_start|>assistant\n")
        assert tok.decode(tok.encode(prompt), skip_special_tokens=False) == prompt


def test_init_starts_one_student_from_a_checkpoints_weights(teacher, trained, tmp_path, capsys):
    """`--init CHECKPOINT`: the student is the checkpoint's weights in fp32 (`new_student`; a checkpoint of another
    family is refused), so the command's first step, on the same batch as the first run's, has a lower loss than the
    fresh student had there. `--init` without exactly one family is an argparse error, before anything is made."""
    out = trained[0]
    checkpoint = out / "echo" / "checkpoint"
    for families in ([], ["--families", "echo", "mamba2"]):
        with pytest.raises(SystemExit) as exit_:
            demo.main(["--teacher", str(teacher), "--out", str(tmp_path / "refused"), "--init", str(checkpoint),
                       *families, *ARGS])  # fmt: skip
        assert exit_.value.code == 2 and "--init" in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()

    tok = Tokenizer(checkpoint)
    a = argparse.Namespace(init=str(checkpoint), seed=0, hidden=64, layers=4, device="cpu", lr=1e-3)
    with torch.inference_mode(False):
        model, _ = demo.new_student("echo", a, tok.vocab_size, tok.eos_token_id, None)
        saved = load_model(checkpoint, device="cpu", dtype=torch.float32).state_dict()
        assert model.training and model.state_dict().keys() == saved.keys()
        assert all(v.dtype == torch.float32 and torch.equal(v, saved[k]) for k, v in model.state_dict().items())
        with pytest.raises(ValueError, match="--init"):
            demo.new_student("mamba2", a, tok.vocab_size, tok.eos_token_id, None)

        second = tmp_path / "second"
        args = ["--teacher", str(teacher), "--out", str(second), "--data", str(out / "data"), "--families", "echo",
                "--init", str(checkpoint), "--steps", "1", *ARGS]  # fmt: skip
        assert demo.main(args) == 0
    assert not (second / "mamba2").exists()
    (started,) = json.loads((second / "echo" / "report.json").read_text())["log"]
    fresh = json.loads((out / "echo" / "report.json").read_text())["log"][0]
    assert started["step"] == fresh["step"] == 1 and started["tokens"] == fresh["tokens"]  # the same batch
    assert started["loss"] < fresh["loss"]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A tiny byte-level BPE trained with `tokenizers` on a few sentences of words no template holds, so that they
    are whole-word tokens (" quokka", " zeppelin", " Leon", " café", ...), with the byte tokenizer's special tokens
    and chat template."""
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    text = ["Hi Leon: quokka zeppelin marmalade walrus.", "Hi Leon: marble copper quokka pelican!",
            "Hi Leon: zeppelin walrus café r2d2 pelican marble.", "Hi Leon: marmalade copper kiwi."]  # fmt: skip
    backend.train_from_iterator(text * 30, trainer)
    path = tmp_path_factory.mktemp("bpe")
    backend.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOS, "eos_token": EOS, "pad_token": EOS,
              "chat_template": CHAT_TEMPLATE, "tool_call_start": "<tool_call>", "tool_call_end": "</tool_call>",
              "model_max_length": 1 << 20}  # fmt: skip
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def test_vocabulary_words_are_the_whole_words_of_a_bpe_vocabulary(bpe):
    """A byte vocabulary has no whole-word tokens; a BPE's are its leading-space tokens of three or more ASCII
    letters, sorted, without the evaluation's recall answers (" Leon" is a token, "Leon" no word) nor words with
    other characters (" café")."""
    assert demo.vocabulary_words(Tokenizer(TINY_CHECKPOINT)) == []
    tok = Tokenizer(bpe)
    tokens = {tok.decode([i]) for i in range(tok.vocab_size)}
    assert {" Leon", " café", " quokka"} <= tokens
    words = demo.vocabulary_words(tok)
    assert words == sorted(set(words)) and {"copper", "marble", "quokka", "zeppelin"} <= set(words)
    assert all(len(w) >= 3 and w.isascii() and w.isalpha() and " " + w in tokens for w in words)
    assert not {w.lower() for w in words} & EVAL_VALUES and "café" not in words and "Leon" not in words


def _target_texts(maker: demo.BatchMaker, steps: range) -> list[str]:
    """The decoded labelled spans of the made-up rows (not the teacher's) of `maker`'s batches at `steps`."""
    texts = []
    for step in steps:
        batch = maker[(step, 100)]
        for ids, labels, taught in zip(batch["ids"], batch["labels"], batch["from_teacher"].tolist(), strict=True):
            if not taught:
                texts += [maker.tok.decode(s, skip_special_tokens=False) for s in _spans(ids.tolist(), labels.tolist())]
    return texts


def test_batch_values_include_words_of_the_vocabulary(bpe):
    """With a BPE tokenizer the made-up rows' targets (calls, results, recall answers) hold its whole words as
    values, several over a few batches; with the byte tokenizer (no whole words) the same batches hold none."""
    tok = Tokenizer(bpe)
    long_words = {w.lower() for w in demo.vocabulary_words(tok) if len(w) >= 5}  # never a made-up word by chance

    def found(texts: list[str]) -> list[str]:
        return [w for t in texts for w in re.findall(r"[A-Za-z]+", t) if w.lower() in long_words]

    with_words = found(_target_texts(demo.BatchMaker(bpe, POOL, 0, 4096, 2048, tok.eos_token_id), range(8)))
    assert len(with_words) >= 4 and len({w.lower() for w in with_words}) >= 3, with_words
    assert found(_target_texts(_maker(), range(8))) == []

"""The wire between the HTTP front and the engine process (engine/serving/ipc.py): every record survives the round
trip."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfree.engine.protocol import (
    EngineInfo,
    EngineRequest,
    Grammar,
    QueueFull,
    RequestOutput,
    SamplingParams,
    SessionBusy,
    SessionNotFound,
    SessionRecord,
    SnapshotError,
    TokenLogprob,
)
from kvfree.engine.serving.ipc import (
    error_from_wire,
    error_to_wire,
    info_from_wire,
    info_to_wire,
    output_from_wire,
    output_to_wire,
    pack,
    params_from_wire,
    params_to_wire,
    record_from_wire,
    record_to_wire,
    request_from_wire,
    request_to_wire,
    unpack,
)


def through_the_wire(value):
    return unpack(pack(value))


def test_sampling_params_cross_unchanged():
    params = SamplingParams(max_tokens=7, temperature=0.5, top_k=3, seed=11, stop=["\n\n", "END"],
                            stop_token_ids=[2, 5], logprobs=2, ignore_eos=True)  # fmt: skip
    assert params_from_wire(through_the_wire(params_to_wire(params))) == params


def test_a_request_crosses_unchanged_with_its_session_and_grammar():
    params = SamplingParams(max_tokens=4, logit_bias={7: -100.0}, grammar=Grammar("regex", "[a-z]+"))
    request = EngineRequest("req-1", [5, 6, 7], params, n=1, session_id="sess_9", owner="key-a", detokenize=False)
    assert request_from_wire(through_the_wire(request_to_wire(request))) == request


def test_outputs_cross_with_their_logprobs_and_finish_reason():
    out = RequestOutput(
        request_id="r#1", index=1, token_ids=[5, 6], text="héllo", finish_reason="stop", prompt_tokens=9,
        cached_tokens=4, completion_tokens=2,
        logprobs=[TokenLogprob(5, -0.25, [(5, -0.25), (7, -1.5)]), TokenLogprob(6, -0.5, [])],
    )  # fmt: skip
    assert output_from_wire("r#1", through_the_wire(output_to_wire(out))) == out


def test_engine_errors_cross_as_their_own_class_and_others_as_runtime_errors():
    for exc in (QueueFull("full"), SessionNotFound("no such session"), SessionBusy("busy"), ValueError("bad")):
        back = error_from_wire(*through_the_wire(error_to_wire(exc)))
        assert type(back) is type(exc) and str(back) == str(exc)
    snapshot = error_from_wire(*through_the_wire(error_to_wire(SnapshotError("sum", "checksum_mismatch"))))
    assert isinstance(snapshot, SnapshotError) and snapshot.code == "checksum_mismatch"
    other = error_from_wire(*through_the_wire(error_to_wire(ZeroDivisionError("x"))))
    assert isinstance(other, RuntimeError) and "ZeroDivisionError" in str(other)
    wrapped = output_from_wire("r", through_the_wire(output_to_wire(QueueFull("later"))))
    assert isinstance(wrapped, QueueFull)


def test_engine_info_and_session_records_cross_unchanged():
    info = EngineInfo(
        checkpoint=Path("/models/m"), layers=("mamba2", "ska"), vocab_size=261, max_context=8192,
        state_bytes_per_token=0, state_bytes_per_session=1234, gpu_slots=4, host_sessions=16, max_sessions=None,
        device="cuda:0", dtype="bfloat16", fingerprint="ab" * 32,
    )  # fmt: skip
    assert info_from_wire(through_the_wire(info_to_wire(info))) == info
    record = SessionRecord("sess_1", 1.5, 2.5, 17, "gpu", 4096)
    assert record_from_wire(through_the_wire(record_to_wire(record))) == record


def test_bytes_cross_as_bytes():
    blob = bytes(range(256)) * 100
    assert through_the_wire(["result", 3, True, blob])[3] == blob


@pytest.mark.parametrize("frame", [b"", b"\xc1"])
def test_a_malformed_frame_raises_instead_of_passing_garbage(frame):
    with pytest.raises(Exception):  # noqa: B017 (msgpack raises its own several kinds)
        unpack(frame)

"""The wire between the HTTP front and the engine process: msgpack frames of plain values, no pickling per token.

Each message is one msgpack array whose first element says what it is:

front -> engine
    ("submit", request_id, prompt_token_ids, params, n, session_id, owner, prefill_only, detokenize): an
                                             `EngineRequest`'s fields, its params as a dict
    ("abort", request_id, choice)            the whole request (choice None), or one of its choices
    ("call", call_id, method, args)         one of `ENGINE_CALLS` (session operations, shutdown phases), or
                                             "stop": the loop answers and exits
engine -> front
    ("ready", info)                          once, after the model is loaded
    ("failed", name, message, code)          instead, when the engine could not start (a bad checkpoint)
    ("outputs", [[request_id, output], ...]) every request's outputs of one step, in one frame
    ("result", call_id, ok, value)           a call's return value, or (ok False) its exception
    ("stats", stats)                         the engine's counters, pushed a few times a second

A snapshot never crosses the pipe: the front names a temporary file, the engine writes the snapshot to it or reads
one from it (`EngineCore.export_session`, `restore_session`), so tens of MB are written once and read once.

A request output is `[index, token_ids, text, logprobs, finish_reason, prompt_tokens, cached_tokens,
completion_tokens]` or, for an error sent to the request, `["error", name, message, code]`. Exceptions travel as
(class name, message, code) and are raised again as the same class on the other side when it is one of the engine's
known errors (`ERRORS`), else as a RuntimeError that names the original.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import msgpack

from kvfree.checkpoints import CheckpointError
from kvfree.engine.protocol import (
    FRONT_ERRORS,
    RECORD_CALLS,
    EngineInfo,
    EngineRequest,
    RequestOutput,
    SamplingParams,
    SessionPage,
    SessionRecord,
    SnapshotError,
    TokenLogprob,
)

# The engine's exceptions a front answers with an HTTP status (server/lifecycle.py), or the CLI with a one-line error
# (a checkpoint that cannot be loaded), by name.
ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls for cls in (*FRONT_ERRORS, CheckpointError, ValueError, KeyError, TypeError)
}


def pack(message: tuple | list) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(frame: bytes) -> list:
    return msgpack.unpackb(frame, raw=False, strict_map_key=False)


# -- records ----------------------------------------------------------------------------------------------------------
def params_to_wire(params: SamplingParams) -> dict[str, Any]:
    return dataclasses.asdict(params)


def params_from_wire(values: dict[str, Any]) -> SamplingParams:
    return SamplingParams(**values)


def request_to_wire(request: EngineRequest) -> list:
    """The fields of a "submit" frame, in `EngineRequest`'s order (its params as a dict)."""
    return [getattr(request, f.name) if f.name != "params" else params_to_wire(request.params)
            for f in dataclasses.fields(request)]  # fmt: skip


def request_from_wire(values: list) -> EngineRequest:
    request = EngineRequest(*values)
    params = params_from_wire(request.params)
    return dataclasses.replace(request, params=params, checkpoint_at=tuple(request.checkpoint_at))  # (msgpack: lists)


def info_to_wire(info: EngineInfo) -> dict[str, Any]:
    values = dataclasses.asdict(info)
    values["checkpoint"] = str(info.checkpoint)
    return values


def info_from_wire(values: dict[str, Any]) -> EngineInfo:
    return EngineInfo(**{**values, "checkpoint": Path(values["checkpoint"]), "layers": tuple(values["layers"])})


def record_to_wire(record: SessionRecord) -> dict[str, Any]:
    return dataclasses.asdict(record)


def record_from_wire(values: dict[str, Any]) -> SessionRecord:
    return SessionRecord(**values)




def result_to_wire(value: Any) -> Any:
    if isinstance(value, SessionPage):
        return {"records": [record_to_wire(r) for r in value.records], "has_more": value.has_more}
    return record_to_wire(value) if isinstance(value, SessionRecord) else value


def result_from_wire(method: str, value: Any) -> Any:
    if method == "list_sessions":
        return SessionPage(tuple(record_from_wire(r) for r in value["records"]), value["has_more"])
    return record_from_wire(value) if method in RECORD_CALLS else value


# -- a request's outputs ----------------------------------------------------------------------------------------------
def output_to_wire(out: RequestOutput | BaseException) -> list:
    if isinstance(out, BaseException):
        return ["error", *error_to_wire(out)]
    logprobs = [_logprob_to_wire(lp) for lp in out.logprobs]
    prompt = None if out.prompt_logprobs is None else [_logprob_to_wire(lp) for lp in out.prompt_logprobs]
    return [out.index, out.token_ids, out.text, logprobs, out.finish_reason, out.prompt_tokens, out.cached_tokens,
            out.completion_tokens, prompt]  # fmt: skip


def _logprob_to_wire(lp: TokenLogprob | None) -> list | None:
    return None if lp is None else [lp.token_id, lp.logprob, [list(pair) for pair in lp.top], lp.rank]


def _logprob_from_wire(values: list | None) -> TokenLogprob | None:
    if values is None:
        return None
    token, logprob, top, rank = values
    return TokenLogprob(token, logprob, [(int(i), v) for i, v in top], rank)


def output_from_wire(request_id: str, values: list) -> RequestOutput | BaseException:
    if values[0] == "error":
        return error_from_wire(*values[1:])
    index, token_ids, text, logprobs, finish_reason, prompt_tokens, cached_tokens, completion_tokens, prompt = values
    return RequestOutput(
        request_id=request_id,
        index=index,
        token_ids=token_ids,
        text=text,
        logprobs=[_logprob_from_wire(lp) for lp in logprobs],
        finish_reason=finish_reason,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        completion_tokens=completion_tokens,
        prompt_logprobs=None if prompt is None else [_logprob_from_wire(lp) for lp in prompt],
    )


# -- exceptions -------------------------------------------------------------------------------------------------------
def error_to_wire(exc: BaseException) -> list:
    message = exc.args[0] if len(exc.args) == 1 and isinstance(exc.args[0], str) else str(exc)
    return [type(exc).__name__, message, getattr(exc, "code", None)]


def error_from_wire(name: str, message: str, code: str | None = None) -> Exception:
    cls = ERRORS.get(name)
    if cls is None:
        return RuntimeError(f"engine error ({name}): {message}")
    if cls is SnapshotError:
        return SnapshotError(message, code or "invalid_snapshot")
    return cls(message)

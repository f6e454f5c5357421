"""Operations routes: liveness, readiness, Prometheus metrics, version (no API key needed), and the small
endpoints tools written for vLLM call: `/ping`, `/tokenize`, `/detokenize`, `/tokenizer_info` (the last three with
the API key)."""

from __future__ import annotations

from importlib import metadata
from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response

from kvfree.server.auth import api_key_owner
from kvfree.server.chat_template import render_chat
from kvfree.server.errors import error_responses
from kvfree.server.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from kvfree.server.state import StateDep, check_model

router = APIRouter(tags=["Operations"])
tokens_router = APIRouter(tags=["Tokens"], dependencies=[Depends(api_key_owner)])


@router.get("/health")
async def health(state: StateDep) -> JSONResponse:
    """200 while the server and its engine (thread or process) are up; 503 when the engine has died (restart it)."""
    if state.engine.alive or not state.engine.accepting:  # not started yet or shutting down: the process is fine
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": "engine stopped"}, status_code=503)


@router.get("/ping")
async def ping(state: StateDep) -> JSONResponse:
    """Liveness under the name some load balancers and tools use (as `/health`)."""
    return await health(state)


@router.get("/version")
async def version() -> dict[str, str]:
    """kvfree's version (of the installed distribution)."""
    try:
        return {"version": metadata.version("kvfree")}
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return {"version": "0.0.0+unknown"}


@router.get("/ready")
async def ready(state: StateDep) -> JSONResponse:
    """200 while the engine accepts work and the session store (if any) answers; 503 with the reason while starting,
    shutting down, or while the store is unreachable (a load balancer then sends sessions elsewhere; liveness,
    `/health`, stays 200)."""
    engine = state.engine
    if not (engine.accepting and engine.alive):
        reason = "the engine has stopped" if engine.accepting else "the server is starting or shutting down"
        return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)
    problem = await engine.session_store_problem()
    if problem is not None:
        return JSONResponse({"status": "unavailable", "reason": problem}, status_code=503)
    return JSONResponse({"status": "ready"})


@router.get("/metrics")
async def metrics(state: StateDep) -> Response:
    """Prometheus metrics: requests, tokens, latencies, sessions by location, pool slots, state bytes, GPU memory."""
    state.metrics.update_engine(state.engine.stats())
    body, content_type = state.metrics.render()
    return Response(content=body, media_type=content_type)


@tokens_router.post("/tokenize", response_model=TokenizeResponse, responses=error_responses(400, 401, 404))
async def tokenize(body: TokenizeRequest, state: StateDep) -> TokenizeResponse:
    """Token ids of a prompt, or of a conversation as a chat request renders it."""
    check_model(state, body.model)
    tok = state.tokenizer
    text = body.prompt
    if body.messages is not None:
        text = render_chat(tok, body.messages, None, add_generation_prompt=body.add_generation_prompt)
    ids = await state.engine.tokenize(tok.encode, text)  # any length (up to the body limit): it only counts
    return TokenizeResponse(count=len(ids), max_model_len=state.settings.max_prompt_tokens, tokens=ids)


@tokens_router.post("/detokenize", response_model=DetokenizeResponse, responses=error_responses(400, 401, 404))
async def detokenize(body: DetokenizeRequest, state: StateDep) -> DetokenizeResponse:
    """The text of token ids (special tokens included, as vLLM)."""
    check_model(state, body.model)
    state.engine.check_token_ids(body.tokens, "tokens")
    return DetokenizeResponse(prompt=state.tokenizer.decode(body.tokens, skip_special_tokens=False))


@tokens_router.get("/tokenizer_info", responses=error_responses(401))
async def tokenizer_info(state: StateDep) -> dict[str, Any]:
    """The served tokenizer's configuration, as vLLM serves it: its `tokenizer_config.json` (the special tokens,
    the chat template) and the longest prompt accepted. Clients that tokenize through the server (lm-evaluation-
    harness's remote tokenizer) read the special tokens and the template here, then call `/tokenize`."""
    tok = state.tokenizer
    info = {key: value for key, value in tok.config.items() if key != "added_tokens_decoder"}
    info.update(
        tokenizer_class=info.get("tokenizer_class", "PreTrainedTokenizerFast"),
        chat_template=tok.chat_template, eos_token=tok.eos_token, bos_token=tok.bos_token,
        pad_token=_token_name(info.get("pad_token")), model_max_length=state.settings.max_prompt_tokens,
    )  # fmt: skip
    return info


def _token_name(value: Any) -> str | None:
    """A special token as tokenizer configs write it: a string, or an AddedToken's `{"content": ...}`."""
    return value.get("content") if isinstance(value, dict) else value

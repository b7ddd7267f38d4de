"""The FastAPI app: build_app(LLM(...)) serves the OpenAI-compatible endpoints over the
AsyncEngine, behind one ASGI guard (origins, API key), with OpenAI-shaped errors everywhere.

    app = build_app(LLM("path/to/checkpoint"))        # or: hybrid serve path/to/checkpoint
    uvicorn.run(app, host="127.0.0.1", port=8000)
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import os
import uuid

from fastapi import Request  # noqa: F401 - module level: FastAPI resolves the endpoints' annotations here
from starlette.datastructures import Headers
from starlette.responses import JSONResponse, Response

from hybrid.async_engine import AsyncEngine, EngineDeadError
from hybrid.chat_template import check_chat_template, reserved_template_kwargs
from hybrid.errors import HybridError, InvalidRequestError
from hybrid.server.api_errors import APIError, error_for, from_invalid, internal_error
from hybrid.server.handlers import Handlers
from hybrid.server.protocol import parse_body
from hybrid.server.reasoning import check_reasoning_parser
from hybrid.server.tool_parsers import check_tool_options

DEFAULT_MAX_QUEUED_REQUESTS = 256
DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024
_PARSE_IN_THREAD_BYTES = 256 * 1024  # larger bodies are parsed off the event loop


def _unwrap(llm_or_engine):
    """(AsyncEngine or None, Engine, tokenizer, the LLM or None) from an LLM, an Engine or an AsyncEngine."""
    if isinstance(llm_or_engine, AsyncEngine):
        return llm_or_engine, llm_or_engine.engine, llm_or_engine.tokenizer, None
    eng = getattr(llm_or_engine, "engine", None)
    if eng is not None:  # an LLM
        return None, eng, getattr(llm_or_engine, "tokenizer", None), llm_or_engine
    return None, llm_or_engine, getattr(llm_or_engine, "tokenizer", None), None


def default_model_name(model_dir: str | None) -> str:
    """The name a checkpoint directory is served under: "hybrid-default" for the bundled model
    (or none), else the directory's name."""
    from hybrid.model_source import DEFAULT_MODEL_DIR

    if not model_dir or os.path.normpath(os.path.abspath(model_dir)) == os.path.normpath(DEFAULT_MODEL_DIR):
        return "hybrid-default"
    return os.path.basename(os.path.normpath(os.path.abspath(model_dir))) or "hybrid"


def model_name_of(llm) -> str:
    """The name an LLM is served under: its Hugging Face repo id when it was named by one (as
    vLLM serves a repo under its id), else default_model_name of its checkpoint directory."""
    return getattr(llm, "hf_repo_id", None) or default_model_name(getattr(llm, "model_dir", None))


# ---------------------------------------------------------------------------------- origin and key
def _with_headers(send, extra: dict[str, str]):
    raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in extra.items()]

    async def wrapped(message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *raw]}
        await send(message)

    return wrapped


class _Guard:
    """ASGI middleware in front of every route (pure ASGI, so streams pass through untouched).

    Cross-origin: a browser request carries an Origin header; one from an origin not in
    `allowed_origins` is refused (403), so no web page can drive the server, and allowed ones get
    CORS headers (preflights answered here). Clients outside a browser send no Origin. With
    `request_id_headers`, every response carries X-Request-Id (the request's own, else a new one).
    API key: with `api_key` set, every /v1 route needs `Authorization: Bearer <key>` (401
    otherwise); /health and /metrics stay open."""

    def __init__(self, app, *, api_key: str | None, allowed_origins: list[str] | None, metrics,
                 request_id_headers: bool = False) -> None:
        self.app = app
        self.request_id_headers = request_id_headers  # (vLLM's --enable-request-id-headers)
        self.api_key = api_key.encode("utf-8") if api_key else None
        origins = [o.strip().rstrip("/").lower() for o in (allowed_origins or []) if o.strip()]
        self.any_origin = "*" in origins
        self.allowed_origins = frozenset(origins)
        self.metrics = metrics

    def origin_allowed(self, origin: str) -> bool:
        return self.any_origin or origin.rstrip("/").lower() in self.allowed_origins

    def authorized(self, header: str | None) -> bool:
        if not header:
            return False
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(token.strip().encode("utf-8"), self.api_key)

    async def reject(self, scope, receive, send, e: APIError, headers: dict[str, str]) -> None:
        self.metrics.on_reject(e.status)
        await JSONResponse(e.body(), status_code=e.status, headers=headers)(scope, receive, send)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        added: dict[str, str] = {}  # headers of every answer: CORS, X-Request-Id
        if self.request_id_headers:  # (on every answer, refusals included: a client's trace finds them all)
            added["X-Request-Id"] = headers.get("x-request-id") or uuid.uuid4().hex
        origin = headers.get("origin")
        if origin is not None:
            if not self.origin_allowed(origin):
                await self.reject(scope, receive, send, APIError(
                    f"cross-origin requests from {origin!r} are not allowed (see --allowed-origins)", 403, None,
                    "origin_not_allowed", type="permission_error"), {**added, "Vary": "Origin"})
                return
            added.update({"Access-Control-Allow-Origin": origin, "Vary": "Origin"})
            if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
                # a preflight: answered here, without the key (browsers never send it on one)
                await Response(status_code=204, headers={
                    **added, "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                    "Access-Control-Allow-Headers": headers.get("access-control-request-headers")
                    or "Authorization, Content-Type",
                    "Access-Control-Max-Age": "600"})(scope, receive, send)
                return
        path = scope["path"]
        if self.api_key is not None and (path == "/v1" or path.startswith("/v1/")):
            if not self.authorized(headers.get("authorization")):
                await self.reject(scope, receive, send, APIError(
                    "Incorrect or missing API key: send 'Authorization: Bearer <key>'.", 401, None,
                    "invalid_api_key"), {**added, "WWW-Authenticate": "Bearer"})
                return
        out = _with_headers(send, added) if added else send
        started = False

        async def tracked(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await out(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as e:
            # a bug in a route: the generic 500 answered here, the exception kept from the server, which
            # would otherwise close the connection after it (a pooled client's next request then fails too)
            if started:
                raise
            err = internal_error(f"{scope['method']} {scope['path']}", e)
            self.metrics.on_reject(err.status)
            await JSONResponse(err.body(), status_code=err.status)(scope, receive, out)


async def _read_json(request, max_bytes: int) -> dict:
    """The request's JSON object: application/json only (a cross-site form or text/plain POST is
    refused), at most max_bytes read (413 past it, before reading more), parsed off the event
    loop when large."""
    ctype = request.headers.get("content-type")
    media = (ctype or "").split(";")[0].strip().lower()
    # JSON, a JSON-based type, or none said (what FastAPI parses as JSON too; a browser always sends one, so
    # the form and text/plain types a cross-site page can send stay refused)
    if ctype is not None and media != "application/json" and not (media.startswith("application/")
                                                                   and media.endswith("+json")):
        raise APIError(f"the request body must be 'application/json', got {ctype!r}", 415, None,
                       "unsupported_media_type")
    too_large = APIError(f"the request body is larger than the limit of {max_bytes} bytes (--max-request-bytes)",
                         413, None, "request_too_large")
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise APIError("invalid Content-Length header", 400, None, "invalid_request")
        if int(length) > max_bytes:
            raise too_large
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > max_bytes:
            raise too_large
        chunks.append(chunk)
    raw = b"".join(chunks)
    if len(raw) > _PARSE_IN_THREAD_BYTES:
        return await asyncio.to_thread(parse_body, raw)
    return parse_body(raw)


# ---------------------------------------------------------------------------------- the app factory
# the OpenAI / vLLM endpoints of other kinds of model, which a client may try: a 404 that says why
NOT_SERVED = {**{path: "embeddings need a pooling model" for path in ("/v1/embeddings", "/pooling", "/classify")},
              **{path: "scoring needs a cross-encoder or pooling model"
                 for path in ("/v1/score", "/score", "/v1/rerank", "/rerank", "/v2/rerank")},
              **{path: "it has no audio or image input or output" for path in (
                  "/v1/audio/transcriptions", "/v1/audio/translations", "/v1/audio/speech",
                  "/v1/images/generations")}}


def check_default_template_kwargs(kwargs: dict | None) -> None:
    """ValueError unless `kwargs` (default_chat_template_kwargs) is None or an object of template variables that
    no request field sets."""
    if kwargs is None:
        return
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ValueError(f"default chat template kwargs must be an object of template variables, got {kwargs!r}")
    reserved = reserved_template_kwargs(kwargs)
    if reserved:
        raise ValueError(f"default chat template kwargs: {', '.join(reserved)} cannot be set there: each "
                         "request's own fields set them")


def build_app(llm_or_engine, served_model_name: str | list[str] | None = None,
              max_queued_requests: int | None = DEFAULT_MAX_QUEUED_REQUESTS, *,
              api_key: str | None = None, allowed_origins: list[str] | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, enable_auto_tool_choice: bool = False,
              tool_call_parser: str | None = None, exclude_tools_when_tool_choice_none: bool = False,
              reasoning_parser: str | None = None, chat_template: str | None = None,
              return_tokens_as_token_ids: bool = False, enable_prompt_tokens_details: bool = False,
              trust_request_chat_template: bool = False, enable_force_include_usage: bool = False,
              enable_request_id_headers: bool = False, disable_fastapi_docs: bool = False,
              default_chat_template_kwargs: dict | None = None):
    """A FastAPI app serving `llm_or_engine` (an LLM, an Engine or an AsyncEngine).

    The engine worker thread starts with the app (lifespan) and stops with it.
    max_queued_requests: how many sequences may wait beyond the engine's max_num_seqs running
    ones before new requests get 429 (None: no limit). api_key: required as a Bearer token on
    /v1/* (None: open). allowed_origins: origins whose browser requests are served ("*": any;
    default none). max_request_bytes: the largest request body accepted (413 past it).
    Tool calling (vLLM's flags): enable_auto_tool_choice with tool_call_parser (a name of
    hybrid.server.tool_parsers.TOOL_PARSERS; ValueError for another) parses the calls out of the
    output for tool_choice "auto"; exclude_tools_when_tool_choice_none: tool_choice "none" renders
    no tools into the prompt. reasoning_parser (a name of hybrid.server.reasoning.REASONING_PARSERS;
    ValueError for another): chat replies carry the model's thought apart from its answer.
    chat_template: a jinja2 chat template (its text) used instead of the checkpoint's (ValueError if it
    does not compile); trust_request_chat_template: a request's own `chat_template` renders its prompt (else
    such a request is a 400, as vLLM's flag of that name). A request's sampling fields that it leaves out take the LLM's default_sampling
    (its generation_config.json's recommendations, as vLLM applies them). return_tokens_as_token_ids:
    logprobs name tokens "token_id:ID" unless a request says otherwise (its field of that name).
    enable_prompt_tokens_details: usage.prompt_tokens_details.cached_tokens, the prompt tokens the prefix
    cache gave (/v1/responses always reports them, as input_tokens_details). served_model_name: a name, or
    several (vLLM's): requests may name any, responses carry the first. enable_force_include_usage: every
    stream ends with its usage chunk; enable_request_id_headers: every response carries X-Request-Id (the
    request's own, else a new one); disable_fastapi_docs: no /docs, /redoc, /openapi.json (vLLM's flags).
    default_chat_template_kwargs: chat template variables every chat request renders with (e.g. enable_thinking),
    under its own chat_template_kwargs (vLLM's --default-chat-template-kwargs; ValueError for a key the request's
    fields set)."""
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from hybrid.metrics import ServerMetrics

    if max_request_bytes < 1:
        raise ValueError("max_request_bytes must be >= 1")
    check_tool_options(enable_auto_tool_choice, tool_call_parser)  # before anything is built
    check_reasoning_parser(reasoning_parser)
    if chat_template is not None:
        check_chat_template(chat_template)
    check_default_template_kwargs(default_chat_template_kwargs)
    async_engine, engine, tokenizer, llm = _unwrap(llm_or_engine)
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
    if not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"served_model_name must be a name or a list of names, got {served_model_name!r}")
    names = names or [model_name_of(llm)]
    name = names[0]
    metrics = ServerMetrics(name)
    if async_engine is None:
        async_engine = AsyncEngine(engine, tokenizer, max_queued_requests=max_queued_requests, metrics=metrics)
    else:
        async_engine.metrics = metrics
        async_engine.max_queued_requests = max_queued_requests
    srv = Handlers(async_engine, tokenizer, name, engine.max_model_len, engine.max_num_seqs,
                   max_queued_requests, metrics, enable_auto_tool_choice=enable_auto_tool_choice,
                   tool_call_parser=tool_call_parser,
                   exclude_tools_when_tool_choice_none=exclude_tools_when_tool_choice_none,
                   reasoning_parser=reasoning_parser, chat_template=chat_template,
                   sampling_defaults=getattr(llm, "default_sampling", None),
                   return_tokens_as_token_ids=return_tokens_as_token_ids,
                   enable_prompt_tokens_details=enable_prompt_tokens_details,
                   trust_request_chat_template=trust_request_chat_template,
                   force_include_usage=enable_force_include_usage, model_aliases=names,
                   default_chat_template_kwargs=default_chat_template_kwargs)
    metrics.bind(async_engine, admitted_requests=lambda: srv.admitted_requests,
                 admitted_seqs=lambda: srv.reserved_seqs)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        async_engine.start()
        try:
            yield
        finally:
            async_engine.shutdown()

    docs = dict(docs_url=None, redoc_url=None, openapi_url=None) if disable_fastapi_docs else {}
    app = FastAPI(title="hybrid", version="0.1.0", lifespan=lifespan, **docs)
    app.state.async_engine = async_engine
    app.state.engine = engine
    app.state.served_model_name = name
    app.state.metrics = metrics
    app.state.server = srv
    app.add_middleware(_Guard, api_key=api_key, allowed_origins=allowed_origins, metrics=metrics,
                       request_id_headers=enable_request_id_headers)

    def error_response(e: APIError) -> JSONResponse:
        if e.status >= 400:
            metrics.on_reject(e.status)
        # a full queue: a client's retry logic (the openai client's among them) reads when to try again
        headers = {"Retry-After": "1"} if e.status == 429 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error_response(e)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(request: Request, e: InvalidRequestError):
        return error_response(from_invalid(e))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        return error_response(APIError(str(e), 400, None, "invalid_value"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        message = str(e.detail)
        if e.status_code == 404 and request.url.path in NOT_SERVED:  # say why, not just "Not Found"
            message = (f"{request.url.path} is not served: this server runs a text-generation model "
                       f"({NOT_SERVED[request.url.path]}); use /v1/completions or /v1/chat/completions")
        return JSONResponse(APIError(message, e.status_code, None, code).body(), status_code=e.status_code)

    @app.exception_handler(HybridError)
    async def _hybrid(request: Request, e: HybridError):  # EngineDeadError, a failed request, ...
        return error_response(error_for(e, f"{request.method} {request.url.path}"))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        return error_response(internal_error(f"{request.method} {request.url.path}", e))

    @app.get("/health")
    async def health():
        dead = async_engine.dead
        if dead is not None:
            # EngineDeadError's message is the engine's own account ("... unrecoverable device error:
            # ..."): say what is known; anything else only by its kind (details in the log)
            why = str(dead) if isinstance(dead, EngineDeadError) else \
                f"the engine stopped ({type(dead).__name__}); see the server log"
            return JSONResponse({"status": "error", "error": why}, status_code=503)
        return {"status": "ok"}

    # vLLM's model card lists one permission object (OpenAI's old schema); clients that read it find it
    permission = {"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": srv.created,
                  "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                  "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False, "organization": "*",
                  "group": None, "is_blocking": False}

    def model_card(served: str) -> dict:
        # root: the served name, never the checkpoint's path on this machine
        return {"id": served, "object": "model", "created": srv.created, "owned_by": "hybrid", "root": name,
                "parent": None, "max_model_len": engine.max_model_len, "permission": [permission]}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(n) for n in names]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id not in names:
            raise APIError(f"The model '{model_id}' does not exist; this server serves '{name}'.", 404, "model",
                           "model_not_found")
        return model_card(model_id)

    @app.get("/metrics")
    async def metrics_endpoint():
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await srv.completions(request, await _read_json(request, max_request_bytes))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await srv.chat(request, await _read_json(request, max_request_bytes))

    @app.post("/v1/responses")
    async def responses(request: Request):
        return await srv.responses(request, await _read_json(request, max_request_bytes))

    # vLLM's other routes that clients and load balancers call
    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        response = srv.response_store.get(response_id)
        if response is None:
            raise APIError(f"No response with id '{response_id}' is stored", 404, "response_id", "not_found")
        return response

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        if not srv.response_store.delete(response_id):
            raise APIError(f"No response with id '{response_id}' is stored", 404, "response_id", "not_found")
        return {"id": response_id, "object": "response", "deleted": True}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await srv.tokenize(await _read_json(request, max_request_bytes))

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await srv.detokenize(await _read_json(request, max_request_bytes))

    @app.get("/version")
    async def version():
        from hybrid import __version__

        return {"version": __version__}

    @app.get("/ping", operation_id="ping_get")  # (one route of two methods would give both one operation id)
    @app.post("/ping", operation_id="ping_post")
    async def ping():
        return await health()

    return app

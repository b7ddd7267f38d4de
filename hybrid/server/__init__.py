"""An OpenAI-compatible HTTP server (FastAPI + uvicorn) over the AsyncEngine.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with "stream": true as
server-sent events, one token delta per event), GET /v1/models, GET /health, GET /metrics
(Prometheus text format).

    app = build_app(LLM("path/to/checkpoint"))        # or: hybrid serve path/to/checkpoint
    uvicorn.run(app, host="127.0.0.1", port=8000)

Errors are OpenAI-shaped: {"error": {"message", "type", "param", "code"}}: 400 for bad requests
(invalid fields, a prompt or max_tokens beyond the context, a request larger than the server
can ever admit), 401 without the API key (--api-key), 403 for a browser request from an origin
not in --allowed-origins, 404 for an unknown model, 413 for a body over --max-request-bytes, 415
for a body that is not application/json, 429 when the admitted sequences would exceed
max_num_seqs + --max-queued-requests, 500 (a generic message; details go to the log).

Every check that can reject a request runs before its response starts, streamed or not: a
stream that got its 200 fails in-band only for errors during generation.

The rooms: protocol.py parses and checks the requests (api_errors.py: the error shapes),
handlers.py admits, tokenizes and renders chats, streaming.py runs the prompts and writes the
response (one path for both endpoints, JSON or SSE), app.py is the FastAPI app and its guard,
options.py the `hybrid serve` flags; tool calling: tool_protocol.py the request's tools and
tool_choice, tool_parsers.py the tool-call formats (--tool-call-parser), tool_tags.py the tags a
tokenizer has as special tokens, tool_calls.py what a request's tool_choice makes of its output.
"""
from hybrid.server.api_errors import APIError
from hybrid.server.app import (DEFAULT_MAX_QUEUED_REQUESTS, DEFAULT_MAX_REQUEST_BYTES, build_app,
                               default_model_name, model_name_of)
from hybrid.server.options import add_serve_parser, run_server, serve_options

__all__ = ["APIError", "DEFAULT_MAX_QUEUED_REQUESTS", "DEFAULT_MAX_REQUEST_BYTES", "build_app", "default_model_name",
           "model_name_of", "add_serve_parser", "run_server", "serve_options"]

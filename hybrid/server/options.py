"""`hybrid serve`'s server flags (hybrid/cli.py adds the engine flags and runs the command), what
they mean for build_app, and running the app under uvicorn."""
from __future__ import annotations

import argparse
import json
import logging
import os

from hybrid.chat_template import check_chat_template
from hybrid.server.app import (DEFAULT_MAX_QUEUED_REQUESTS, DEFAULT_MAX_REQUEST_BYTES, build_app,
                               check_default_template_kwargs)
from hybrid.server.reasoning import REASONING_PARSERS
from hybrid.server.tool_parsers import TOOL_PARSERS, check_tool_options

logger = logging.getLogger("hybrid.server")


def add_serve_parser(subparsers, add_engine_args) -> argparse.ArgumentParser:
    """The `serve` subcommand: the engine flags (add_engine_args) and the server's."""
    p = subparsers.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, nargs="+", metavar="NAME",
                   help="model name(s) clients pass; responses carry the first (default: the hub repo id "
                        "owner/name of a cached model, else the checkpoint directory's name)")
    p.add_argument("--max-queued-requests", type=int, default=DEFAULT_MAX_QUEUED_REQUESTS,
                   help="sequences allowed to wait beyond --max-num-seqs running ones; more get 429 "
                        f"(default {DEFAULT_MAX_QUEUED_REQUESTS}; -1: no limit)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: env HYBRID_API_KEY; unset: open)")
    p.add_argument("--allowed-origins", action="append", default=None, metavar="ORIGINS",
                   help="comma-separated origins (e.g. http://localhost:3000) whose browser requests are served, "
                        "'*' for any; repeatable (default: none, cross-origin browser requests get 403)")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help=f"largest request body accepted; larger ones get 413 (default {DEFAULT_MAX_REQUEST_BYTES})")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='parse tool calls out of chat outputs for tool_choice "auto" (the default when a request '
                        "has tools); needs --tool-call-parser")
    p.add_argument("--tool-call-parser", default=None, metavar="NAME",
                   help="the model's tool-call format: " + ", ".join(sorted(TOOL_PARSERS))
                        + " (hermes: Granite 4.0, Qwen, Hermes; granite: Granite 3.x; nemotron_json: Nemotron Nano v2; "
                          "qwen3_coder: Nemotron 3 Nano)")
    p.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                   help="split a thinking model's <think>...</think> from its answer in chat replies "
                        "(message.reasoning / reasoning_content, delta.reasoning when streamed); "
                        "nemotron_v3: Nemotron 3 Nano; deepseek_r1 / qwen3: Nemotron Nano v2, Falcon-H1R")
    p.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                   help='with tool_choice "none", do not render the tools into the prompt (default: rendered)')
    p.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help='logprobs name each token "token_id:ID" instead of its text (a request\'s own '
                        "return_tokens_as_token_ids field wins)")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="usage.prompt_tokens_details.cached_tokens: the prompt tokens served from the prefix cache")
    p.add_argument("--chat-template", default=None, metavar="TEMPLATE",
                   help="a jinja2 chat template used instead of the checkpoint's: a file, or the template text itself")
    p.add_argument("--default-chat-template-kwargs", type=_template_kwargs, default=None, metavar="JSON",
                   help="chat template variables for every chat request, under its own chat_template_kwargs, e.g. "
                        "'{\"enable_thinking\": false}'")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="let a request's own chat_template field render its prompt (refused with a 400 otherwise)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--uvicorn-log-level", default=None,
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's log level (default: --log-level's)")
    p.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="no line per HTTP request in the log (the startup phases and warnings stay)")
    p.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this key file (and --ssl-certfile)")
    p.add_argument("--ssl-certfile", default=None, help="the certificate file of HTTPS")
    p.add_argument("--ssl-ca-certs", default=None, help="CA certificates for client verification")
    p.add_argument("--root-path", default=None, help="the path prefix a proxy in front of the server strips")
    p.add_argument("--enable-force-include-usage", action="store_true",
                   help="every streamed response ends with a usage chunk, whether or not its request asked")
    p.add_argument("--enable-request-id-headers", action="store_true",
                   help="responses carry X-Request-Id: the request's own, else a new one")
    p.add_argument("--disable-fastapi-docs", action="store_true", help="no /docs, /redoc or /openapi.json")
    p.add_argument("--response-role", default="assistant", help="assistant only (the chat replies' role)",
                   type=lambda v: v if v == "assistant" else _bad_value("--response-role", v, "replies are the "
                                                                        "assistant's"))
    # flags of vLLM's server that model cards pass: accepted so their commands run, changing nothing here
    noop = p.add_argument_group("vLLM server flags accepted with no effect")
    for flag in ("--disable-log-requests", "--enable-log-requests", "--disable-frontend-multiprocessing",
                 "--enable-log-outputs", "--enable-server-load-tracking"):
        noop.add_argument(flag, action="store_true", help="no effect")
    for flag, why in (("--max-log-len", "requests are not logged"),
                      ("--chat-template-content-format", "text parts are joined into one string for every template"),
                      ("--guided-decoding-backend", "structured outputs use llguidance"),
                      ("--structured-outputs-config", "structured outputs use llguidance"),
                      ("--collect-detailed-traces", "no tracing"), ("--otlp-traces-endpoint", "no tracing"),
                      ("--show-hidden-metrics-for-version", "every metric is shown")):
        noop.add_argument(flag, default=None, help=f"no effect: {why}")
    return p


def _template_kwargs(text: str) -> dict:
    """argparse type of --default-chat-template-kwargs: a JSON object of template variables."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    try:
        check_default_template_kwargs(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def _bad_value(flag: str, value: str, why: str):
    raise argparse.ArgumentTypeError(f"{flag} {value!r} is not supported: {why}")


def read_chat_template(value: str) -> str:
    """--chat-template's template text, as vLLM reads the flag: the file's contents if `value` is a
    file, else `value` itself when it looks like a template (it has a `{`). ValueError otherwise, or if
    the template does not compile (checked now, before the model loads)."""
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template {value}: cannot read the file ({e})") from None
    elif "{" in value:
        text = value
    else:
        raise ValueError(f"--chat-template {value}: no such file (and not a template's text: it has no '{{')")
    try:
        check_chat_template(text)
    except ValueError as e:
        raise ValueError(f"--chat-template {value if text is not value else '(text)'}: {e}") from None
    return text


def serve_options(args: argparse.Namespace, environ=os.environ) -> dict:
    """build_app's keyword arguments from `hybrid serve`'s flags (and HYBRID_API_KEY)."""
    limit = args.max_queued_requests
    if limit is not None and limit < 0:
        limit = None
    origins = [o for flag in (args.allowed_origins or []) for o in flag.split(",") if o.strip()]
    if args.max_request_bytes < 1:
        raise ValueError("--max-request-bytes must be >= 1")
    check_tool_options(args.enable_auto_tool_choice, args.tool_call_parser)  # at startup, before the model loads
    options = {"max_queued_requests": limit, "api_key": args.api_key or environ.get("HYBRID_API_KEY") or None,
               "allowed_origins": origins, "max_request_bytes": args.max_request_bytes,
               "enable_auto_tool_choice": args.enable_auto_tool_choice, "tool_call_parser": args.tool_call_parser,
               "exclude_tools_when_tool_choice_none": args.exclude_tools_when_tool_choice_none,
               "reasoning_parser": args.reasoning_parser}
    for flag in ("return_tokens_as_token_ids", "enable_prompt_tokens_details", "trust_request_chat_template",
                 "enable_force_include_usage", "enable_request_id_headers",
                 "disable_fastapi_docs"):  # on when given (build_app: off)
        if getattr(args, flag):
            options[flag] = True
    if args.chat_template is not None:  # only when given: build_app's default is the checkpoint's template
        options["chat_template"] = read_chat_template(args.chat_template)
    if args.default_chat_template_kwargs is not None:
        options["default_chat_template_kwargs"] = args.default_chat_template_kwargs
    return options


def run_server(llm, args: argparse.Namespace, options: dict) -> None:
    """Serve `llm` with `hybrid serve`'s flags (`options`: serve_options(args)) until stopped."""
    import uvicorn

    app = build_app(llm, served_model_name=args.served_model_name, **options)
    logger.info("serving '%s' on http://%s:%d/v1%s%s%s", app.state.served_model_name, args.host, args.port,
                " (API key required)" if options["api_key"] else "",
                f" (auto tool choice: {options['tool_call_parser']})" if options.get("enable_auto_tool_choice") else "",
                f" (reasoning parser: {options['reasoning_parser']})" if options.get("reasoning_parser") else "")
    tls = {k: getattr(args, k) for k in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "root_path")
           if getattr(args, k, None) is not None}
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level or args.log_level,
                access_log=not args.disable_uvicorn_access_log, **tls)

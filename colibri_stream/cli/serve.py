"""`colibri-stream serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn) over one model."""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import sys
from pathlib import Path
from typing import cast

from colibri_stream.cli.help import help_options
from colibri_stream.cli.options import (
    add_runtime_arguments,
    add_setting_arguments,
    positive_int,
    runtime_options,
    session_wait,
)
from colibri_stream.errors import ColibriError

DEMO_NAME = "colibri-demo"  # the model id of `serve` without PATH
DEFAULT_MAX_CONNECTIONS = 64  # serve/ needs FastAPI and uvicorn (an extra): imported only when serving

EPILOG = """\
examples:
  colibri-stream serve                                # the shipped demo model, for trying clients and agents
  colibri-stream serve MODEL.cstream --budget budgets/laptop-32g.toml
  colibri-stream serve MODEL.cstream --port 8080 --slots 2 --max-queue 4 --model-name dsv3
  COLIBRI_API_KEYS=key-a,key-b colibri-stream serve MODEL.cstream --host 0.0.0.0   # keys required

  then, from any OpenAI or Anthropic client or coding agent (base URL http://127.0.0.1:8000/v1 and any
  key); a stateless client's repeated prompt prefix is reused by the prefix cache, and the header
  X-Colibri-Session names a KV session kept across requests and restarts:
  curl http://127.0.0.1:8000/v1/chat/completions -H 'content-type: application/json' \\
    -H 'X-Colibri-Session: alice' -d '{"model": "dsv3", "messages": [{"role": "user", "content": "Hi"}]}'

endpoints: GET /v1/models, POST /v1/chat/completions, POST /v1/completions, POST /v1/responses
(JSON or "stream": true for SSE), POST /v1/messages (Anthropic), GET /health (slots busy, queue,
served/cancelled counts; needs no key). Any `model` a request names is served by the one model
(responses name --model-name); --strict-model-name answers 404 for names other than --model-name and the --alias names.
without --api-key the server is single-tenant: any client can use any session by naming it in the header.
with keys (--api-key, repeatable, and/or COLIBRI_API_KEYS=k1,k2) /v1 needs `Authorization: Bearer KEY`
(or `x-api-key: KEY`), and each key's X-Colibri-Session names only that key's sessions.
limits: bodies over 4 MiB get 413, a body not sent within 30 s 408, headers not sent within 10 s close
the connection, connections beyond --max-connections get 503.
exit status: 0 after a clean shutdown (Ctrl-C / SIGTERM), 1 on a user error (bad path, budget,
template), 2 on bad flags."""


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve PATH over /v1/chat/completions, /v1/completions and /v1/models (JSON and SSE). "
        "Up to --slots requests decode together (continuous batching: one forward per step over all of them, "
        "each with its own KV; greedy answers are those of each request alone); --max-queue more wait, the rest "
        "get 503. The RAM check counts 2 x --slots KV caches at the context (--context): the batch's, and as many "
        "sessions kept in memory between requests.",
        **help_options(EPILOG),
    )
    add_runtime_arguments(parser, path_help=f"left out: the shipped demo model (converted once), named {DEMO_NAME!r}")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    parser.add_argument(
        "--slots", type=int, default=4, help="requests decoded together, and sessions kept in memory (default 4)"
    )
    parser.add_argument("--max-queue", type=int, default=16, help="requests waiting for a slot before 503 (default 16)")
    parser.add_argument(
        "--model-name", help="the model id /v1/models lists and responses name (default: PATH's directory name)"
    )
    parser.add_argument(
        "--alias",
        action="append",
        default=[],
        metavar="NAME",
        help="another name /v1/models lists for the model (repeatable; accepted under --strict-model-name)",
    )
    parser.add_argument(
        "--strict-model-name",
        action="store_true",
        help="answer 404 for a request naming another model than --model-name or an --alias "
        "(default: any name is served by the one model)",
    )
    add_setting_arguments(parser, "serve")  # --default-max-tokens (budget key serve.default_max_tokens)
    parser.add_argument(
        "--api-key",
        action="append",
        metavar="KEY",
        help="require this API key (repeatable; COLIBRI_API_KEYS=k1,k2 adds more); default: no authentication",
    )
    parser.add_argument(
        "--max-connections",
        type=positive_int,
        default=DEFAULT_MAX_CONNECTIONS,
        help=f"open connections before 503s (default {DEFAULT_MAX_CONNECTIONS})",
    )
    parser.add_argument(
        "--request-log",
        type=Path,
        metavar="FILE",
        help="append one JSON line per HTTP request to FILE when its answer ends: route, status, prompt and "
        "cached tokens, time to first token, tool calls parsed, a refusal's message (default: none)",
    )
    parser.set_defaults(handler=run_serve)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def run_serve(args: argparse.Namespace) -> int:
    try:
        from colibri_stream.serve.app import Server, create_app
        from colibri_stream.serve.auth import ApiKeys
        from colibri_stream.serve.http import HttpLimits, run_server, server_config
        from colibri_stream.serve.request_log import RequestLog
    except ModuleNotFoundError as exc:
        if exc.name not in ("fastapi", "uvicorn", "starlette", "h11"):
            raise
        raise ColibriError("serve needs FastAPI and uvicorn: pip install 'colibri-stream[serve]'") from None
    from colibri_stream.runtime.turn import load_runtime

    if args.slots < 1 or args.max_queue < 0:
        raise ColibriError(f"--slots must be >= 1 and --max-queue >= 0, got {args.slots} and {args.max_queue}")
    keys = ApiKeys.from_sources(args.api_key)  # refuses blank keys before the (slow) model load
    path = args.path
    if path is None:  # the demo: agents can be pointed at it with nothing else installed
        from colibri_stream.cli.demo import demo_source

        path = demo_source(None)
    name = args.model_name or (DEMO_NAME if args.path is None else None)
    options = runtime_options(args, model_id=name)
    # The batch's caches and as many sessions kept in memory between requests, each up to the context.
    options = dataclasses.replace(options, store=dataclasses.replace(options.store, kv_sequences=2 * args.slots))
    runtime = load_runtime(path, options)
    try:
        server = Server(
            runtime,
            args.slots,
            args.max_queue,
            cast(int, options.store["default_max_tokens"]),  # a COUNT row: an int, checked
            args.kv_sync_every,
            keys,
            strict_model_name=args.strict_model_name,
            aliases=args.alias,
            session_wait=session_wait(args, "serve"),
            request_log=RequestLog(args.request_log) if args.request_log is not None else None,
        )
        server.check_chat_template()  # a broken template stops the start, not every chat request
        if not _is_loopback(args.host) and not keys.enabled:
            print(
                f"colibri-stream serve: warning: binding {args.host} without --api-key: anyone who can reach it "
                "can use any session",
                file=sys.stderr,
            )
        template = "fallback template" if runtime.text_side()[1].is_fallback else "model's chat template"
        auth = f", {len(keys.keys)} API key(s)" if keys.enabled else ""
        print(f"serving {runtime.model_id!r} ({template}{auth}) on http://{args.host}:{args.port}/v1", file=sys.stderr)
        limits = HttpLimits(max_connections=args.max_connections)
        # Shutdown waits at most 10 s for open streams; those left are cancelled, which cancels their jobs.
        config = server_config(
            create_app(server), args.host, args.port, limits, log_level="warning", timeout_graceful_shutdown=10
        )
        if not run_server(config):
            raise ColibriError(f"could not serve on {args.host}:{args.port} (uvicorn's message is above)")
    finally:
        runtime.close()
    return 0

"""`colibri-stream serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn) over one model."""

from __future__ import annotations

import argparse
import ipaddress
import sys

from colibri_stream.cli.help import help_options
from colibri_stream.cli.options import add_runtime_arguments, runtime_options
from colibri_stream.errors import ColibriError

EPILOG = """\
examples:
  colibri-stream serve MODEL.cstream --budget budgets/laptop-32g.toml
  colibri-stream serve MODEL.cstream --port 8080 --slots 2 --max-queue 4 --model-name dsv3

  then, from any OpenAI client (the `user` field names the KV session, reused across requests):
  curl http://127.0.0.1:8000/v1/chat/completions -H 'content-type: application/json' \\
    -d '{"model": "dsv3", "user": "alice", "messages": [{"role": "user", "content": "Hi"}]}'

endpoints: GET /v1/models, POST /v1/chat/completions, POST /v1/completions (JSON or "stream": true
for SSE), GET /health (slots busy, queue, served/cancelled counts).
exit status: 0 after a clean shutdown (Ctrl-C / SIGTERM), 1 on a user error (bad path, budget,
template), 2 on bad flags."""


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve PATH over /v1/chat/completions, /v1/completions and /v1/models (JSON and SSE). "
        "One generation runs at a time; --slots requests are admitted, --max-queue more wait, the rest get 503.",
        **help_options(EPILOG),
    )
    add_runtime_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    parser.add_argument("--slots", type=int, default=4, help="requests admitted at once (default 4)")
    parser.add_argument("--max-queue", type=int, default=16, help="requests waiting for a slot before 503 (default 16)")
    parser.add_argument("--model-name", help="the model id clients send (default: PATH's directory name)")
    parser.add_argument(
        "--default-max-tokens",
        type=int,
        help="answer length when a request sets none (default: the rest of the context)",
    )
    parser.set_defaults(handler=run_serve)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def run_serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn
    except ImportError:
        raise ColibriError("serve needs FastAPI and uvicorn: pip install 'colibri-stream[serve]'") from None
    from colibri_stream.conversation import load_runtime
    from colibri_stream.serve.app import Server, create_app

    if args.slots < 1 or args.max_queue < 0:
        raise ColibriError(f"--slots must be >= 1 and --max-queue >= 0, got {args.slots} and {args.max_queue}")
    runtime = load_runtime(args.path, runtime_options(args, model_id=args.model_name))
    server = Server(runtime, args.slots, args.max_queue, args.default_max_tokens, args.kv_sync_every)
    if not _is_loopback(args.host):
        print(f"colibri-stream serve: warning: binding {args.host}: the API has no authentication", file=sys.stderr)
    template = "fallback template" if runtime.text_side()[1].is_fallback else "model's chat template"
    print(f"serving {runtime.model_id!r} ({template}) on http://{args.host}:{args.port}/v1", file=sys.stderr)
    try:
        # Shutdown waits at most 10 s for open streams; those left are cancelled, which cancels their jobs.
        uvicorn.run(
            create_app(server), host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=10
        )
    finally:
        runtime.close()
    return 0

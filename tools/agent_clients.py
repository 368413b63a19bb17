"""The real coding agents against `colibri-stream serve` on the demo model, two turns each, and a table
(client, version, exit status, turns, tool calls parsed, TTFT of the first and second request, cached
tokens of the second). Not a test: installs take minutes (npm and PyPI are needed once; the clients are
kept in the cache). colibri_stream/devtools/agent_clients/ says what each client is given and how a run is
measured.

    python tools/agent_clients.py [--cache ~/.cache/colibri-stream/agents] [--model PATH]
                                  [--clients claude_code,codex,opencode,aider] [--timeout 900]
                                  [--work DIR] [--record DIR [--fixtures tests/fixtures/agents]]
                                  [--no-install] [--json FILE] [--serve-flags '--default-max-tokens 16384']

--record DIR puts a recording proxy between the clients and the server: every request each client sends
(headers with keys redacted, body, the answer's status and first characters) is saved under
DIR/<client>/; with --fixtures, each client's first-turn main request is also written there as
<client>_recorded.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

from colibri_stream.checkpoint.demo_model import demo_model_dir
from colibri_stream.devtools.agent_clients.clients import CLIENTS, install
from colibri_stream.devtools.agent_clients.runner import extract_fixtures, report, run_all
from colibri_stream.paths import user_cache_dir


def log(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", type=Path, default=user_cache_dir("agents"), help="where the clients are installed")
    parser.add_argument("--model", type=Path, help="what serve serves (default: the shipped demo model)")
    labels = [c.label for c in CLIENTS]
    parser.add_argument("--clients", default=",".join(labels), help=f"comma-separated, of {labels}")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds each turn may take (default 900)")
    parser.add_argument("--work", type=Path, help="run folder (default: a new temporary one, kept)")
    parser.add_argument("--record", type=Path, help="save every request the clients send under this folder")
    parser.add_argument("--fixtures", type=Path, help="with --record: write <client>_recorded.json here")
    parser.add_argument("--no-install", action="store_true", help="use the clients already in the cache")
    parser.add_argument("--json", type=Path, help="also write every turn's requests and results here")
    parser.add_argument("--serve-flags", default="", help="more flags for serve, e.g. '--default-max-tokens 16384'")
    args = parser.parse_args()
    chosen = [label for label in args.clients.split(",") if label]
    if unknown := set(chosen) - set(labels):
        parser.error(f"--clients: unknown {sorted(unknown)}; known: {labels}")
    if not args.no_install:
        install(args.cache, log)
    work = args.work or Path(tempfile.mkdtemp(prefix="colibri-agents-"))
    log(f"run folder: {work} (server log, request log, each client's output and home)")
    flags = args.serve_flags.split()
    runs = run_all(args.model or demo_model_dir(), args.cache, work, chosen, args.timeout, args.record, log, flags)
    print(report(runs))
    if args.record is not None and args.fixtures is not None:
        for path in extract_fixtures(args.record, args.fixtures, runs):
            log(f"fixture: {path}")
    if args.json is not None:
        rows = [
            {"client": r.client.name, "version": r.version, "turns": [dataclasses.asdict(t) for t in r.turns]}
            for r in runs
        ]
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`colibri-stream kv ls|info|rm` (the sessions stored for a model) and the prefix cache's actions (kv_prefix.py)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from colibri_stream.checkpoint.fingerprint import model_fingerprint
from colibri_stream.cli.help import help_options
from colibri_stream.cli.kv_prefix import ACTIONS as PREFIX_ACTIONS
from colibri_stream.cli.kv_prefix import add_actions as add_prefix_actions
from colibri_stream.cli.kv_prefix import run_prefix_action
from colibri_stream.errors import SessionError
from colibri_stream.runtime.kv.lock import SessionLease
from colibri_stream.runtime.kv.sessions import (
    SESSION_SUFFIX,
    TRANSCRIPT_SUFFIX,
    check_session_name,
    default_kv_dir,
    session_info,
    session_path,
)
from colibri_stream.runtime.kv.transcript import remove_transcript
from colibri_stream.runtime.loader import model_config
from engine.config.args import ModelArgs
from storage.kv.log import remove_log

KV_EPILOG = """\
examples:
  colibri-stream kv ls MODEL.cstream
  colibri-stream kv info MODEL.cstream chat --json
  colibri-stream kv rm MODEL.cstream chat          # refused while another process has it open
  colibri-stream kv prefix MODEL.cstream           # the shared prefix cache: blocks, tokens, bytes
  colibri-stream kv export MODEL.cstream agent.kvpack --prompt-file preamble.txt
  colibri-stream kv import MODEL.cstream agent.kvpack --verify 16   # elsewhere: values checked, 32 recomputed
A session whose header is damaged is listed as "corrupt header"; `kv rm` (or run --reset) clears it.
exit status: 0 on success, 1 for an unknown session or one in use, 2 on bad flags."""


KV_DIR_HELP = "session directory (default: ~/.cache/colibri-stream/kv/<model>)"


def add_parser(commands: argparse._SubParsersAction) -> None:
    kv = commands.add_parser(
        "kv",
        help="list, inspect or delete a model's stored sessions and its shared prefix cache; KV packs",
        description="Sessions are per model: MODEL (a container or HF directory) selects their directory.",
        **help_options(KV_EPILOG),
    )
    actions = kv.add_subparsers(dest="kv_command", metavar="ACTION", required=True)
    for name, text in (("ls", "list sessions"), ("info", "show one session"), ("rm", "delete one session")):
        action = actions.add_parser(name, help=text, description=text)
        action.add_argument("model", help="container or HF checkpoint directory")
        if name != "ls":
            action.add_argument("session", help="session name")
        action.add_argument("--kv-dir", help=KV_DIR_HELP)
        action.add_argument("--json", action="store_true", help="JSON output")
        action.set_defaults(handler=run_kv)
    add_prefix_actions(actions, KV_DIR_HELP, run_kv)


def run_kv(args: argparse.Namespace) -> int:
    if args.kv_command not in ("ls", *PREFIX_ACTIONS):
        check_session_name(args.session)  # before the model is read: "../x" names nothing of ours
    model_args = ModelArgs.from_hf_config(model_config(args.model))  # first: a bad MODEL is refused here
    if args.kv_command in PREFIX_ACTIONS:
        return run_prefix_action(args, model_args)
    kv_dir = Path(args.kv_dir) if args.kv_dir else default_kv_dir(model_fingerprint(args.model))
    if args.kv_command == "ls":
        infos = [session_info(p, model_args) for p in sorted(kv_dir.glob(f"*{SESSION_SUFFIX}"))]
        if args.json:
            print(json.dumps(infos))
        for info in [] if args.json else infos:
            state = f"{info['tokens']} tokens" if info["header"] == "ok" else info["header"]
            print(f"{info['session']}\t{state}\t{info['file_bytes']} bytes")
        return 0
    path = session_path(kv_dir, args.session)
    if not path.is_file() or path.is_symlink():
        if os.path.lexists(path):  # a link, directory, FIFO or device under a session's name: not ours
            raise SessionError(f"{path}: session {args.session!r} is not a regular file; remove it by hand")
        raise SessionError(f"{path}: no such session")
    if args.kv_command == "info":
        info = session_info(path, model_args)
        print(json.dumps(info) if args.json else "\n".join(f"{k}: {v}" for k, v in info.items()))
        return 0
    # Refused while a process holds the session (a chat between its turns too), then the log's own lock
    with SessionLease(kv_dir, check_session_name(args.session)) as lease:
        remove_log(path)  # refuses a session in use or a file without our magic; needs no valid header
        remove_transcript(session_path(kv_dir, args.session, TRANSCRIPT_SUFFIX), args.session)
        lease.path.unlink(missing_ok=True)  # a process that opened it meanwhile locks the next one
    print(f"removed {path}")
    return 0

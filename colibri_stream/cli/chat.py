"""`colibri-stream chat`: an interactive conversation on stdin/stdout that survives restarts.

Each user line is appended to the conversation, the model's chat template renders the whole of it,
and the session's KV log supplies every position it already holds, so a turn prefills only what is
new — also in a new process, since the log and the transcript (``<session>.chat.json`` beside it)
are on disk.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from typing import Any

from colibri_stream.cli.help import help_options
from colibri_stream.cli.options import (
    add_runtime_arguments,
    add_sampling_arguments,
    runtime_options,
    sampling,
    session_wait,
)
from colibri_stream.runtime.kv.lock import SessionLease
from colibri_stream.runtime.kv.sessions import SESSION_SUFFIX, TRANSCRIPT_SUFFIX, check_session_name, session_info
from colibri_stream.runtime.kv.transcript import load_transcript, remove_transcript
from colibri_stream.runtime.turn import Runtime, TurnOptions, TurnResult, load_runtime, run_turn
from colibri_stream.text.chat_format import IncrementalDecoder
from storage.files.atomic import atomic_write_json

EPILOG = """\
examples:
  colibri-stream chat MODEL.cstream --budget budgets/laptop-32g.toml
  colibri-stream chat MODEL.cstream --session work --system "You are terse."
  printf 'Hi\\nAnd then?\\n' | colibri-stream chat MODEL.cstream --session scripted

commands at the prompt: :reset (forget the conversation), :stats (session and store totals),
:quit (or Ctrl-D). Ctrl-C stops the answer being written; the conversation keeps what was said.
after each answer one line on stderr: decode tok/s, time to first token, expert hit rate, MB read
from disk per token, and how many tokens were reused from the session instead of prefilled.
another process's session is refused naming its pid; --wait-session waits for it to end instead.
exit status: 0 on :quit or end of input, 1 on a user error (bad path, budget, session in use),
2 on bad flags, 130 on Ctrl-C at the prompt."""


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "chat",
        help="chat with a model on the terminal (the conversation survives restarts)",
        description="Read user lines from stdin, stream the answers, keep the conversation in a session.",
        **help_options(EPILOG),
    )
    add_runtime_arguments(parser)
    parser.add_argument("--session", default="chat", help="conversation name (default: chat)")
    parser.add_argument("--system", help="system message for a new conversation")
    parser.add_argument("--reset", action="store_true", help="start the session over (its transcript and KV log)")
    add_sampling_arguments(parser, 512, "longest answer")
    parser.set_defaults(handler=run_chat)


class Chat:
    """The conversation of one session: messages on disk, KV in the session log."""

    def __init__(self, runtime: Runtime, args: argparse.Namespace):
        self.runtime, self.args = runtime, args
        self.name = check_session_name(args.session)
        self.transcript = runtime.kv_dir / f"{self.name}{TRANSCRIPT_SUFFIX}"
        self.sampling = sampling(args)
        self.stop = threading.Event()
        self.turns: list[dict[str, Any]] = []
        self.pending_reset = False
        self.messages: list[dict[str, str]] = []
        if args.reset:  # also the way out of a damaged transcript (load_transcript's error says so)
            self.reset()
        else:
            self.messages = load_transcript(self.transcript, self.name) or self._fresh()

    def _fresh(self) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.args.system}] if self.args.system else []

    def _save(self) -> None:
        self.transcript.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.transcript, {"messages": self.messages})

    def reset(self) -> None:
        self.messages = self._fresh()
        remove_transcript(self.transcript, self.name)
        self.pending_reset = True  # the KV log is cut at the next turn (it is opened only during turns)

    def ask(self, text: str) -> TurnResult | None:
        """Answer one user line, streaming it to stdout; None when it cannot fit the context."""
        tokenizer, chat = self.runtime.text_side()
        messages = [*self.messages, {"role": "user", "content": text}]
        prompt = self.runtime.encode_chat(messages)  # what the user typed is text, never a special token
        room = self.runtime.context_size - len(prompt)
        if room <= 0:
            print(
                f"error: the conversation has {len(prompt)} tokens; the context is "
                f"{self.runtime.context_size} (:reset to start over)",
                file=sys.stderr,
            )
            return None
        decoder = IncrementalDecoder(tokenizer, chat.stop_ids)
        self.stop.clear()
        previous = signal.signal(signal.SIGINT, lambda *_: self.stop.set())
        try:
            options = TurnOptions(
                min(self.args.max_new_tokens, room),
                self.sampling,
                self.name,
                self.pending_reset,
                self.runtime.stop_ids,
                self.args.kv_sync_every,
                on_token=lambda t: print(decoder.push(t), end="", flush=True),
                should_stop=self.stop.is_set,
            )
            turn = run_turn(self.runtime, prompt, options)
        finally:
            signal.signal(signal.SIGINT, previous)
        print(decoder.flush(), flush=True)
        self.pending_reset = False
        self.messages = [*messages, {"role": "assistant", "content": decoder.text}]
        self._save()
        self.turns.append(turn.stats)
        return turn

    def stats(self) -> dict[str, Any]:
        log = self.runtime.kv_dir / f"{self.name}{SESSION_SUFFIX}"
        info = session_info(log, self.runtime.loaded.args) if log.is_file() else {"tokens": 0}
        return {
            "session": self.name,
            "messages": len(self.messages),
            "stored_tokens": info["tokens"],
            "turns_this_run": len(self.turns),
            "last_turn": self.turns[-1] if self.turns else None,
            "store": self.runtime.loaded.experts.report(),
        }


def footer(turn: TurnResult) -> str:
    """One line: what the turn cost, measured."""
    s = turn.stats
    tokens = s["prefill_tokens"] + s["decode_tokens"]
    if s["store"] == "resident":
        hits = "resident"
    else:
        hits = "n/a" if s["hit_rate"] is None else f"{100 * s['hit_rate']:.1f}%"
    mb = s.get("expert_bytes_read", 0) / 1e6 / max(1, tokens)
    note = " (stopped)" if turn.finish_reason == "cancelled" else ""
    return (
        f"[{len(turn.ids)} tok at {s['decode_tok_per_s']:.1f} tok/s, TTFT {s['ttft_s']:.2f}s, hits {hits}, "
        f"{mb:.2f} MB/tok read, reused {s['reused_tokens']} tok]{note}"
    )


def run_chat(args: argparse.Namespace) -> int:
    sampling(args)  # refuse bad sampling flags and the session name before the (slow) model load
    check_session_name(args.session)
    runtime = load_runtime(args.path, runtime_options(args))
    try:
        # Held before the transcript is read, until exit: another process on this session would write
        # its turns over ours (its transcript and log replacing what we acknowledged), so it is refused.
        with SessionLease(runtime.kv_dir, args.session, session_wait(args, "chat")):
            chat = Chat(runtime, args)
            interactive = sys.stdin.isatty()
            state = f"resumed, {len(chat.messages)} messages" if chat.messages else "new"
            print(f"{runtime.model_id}: session {chat.name!r} ({state}); :reset :stats :quit", file=sys.stderr)
            return _loop(chat, interactive)
    finally:
        runtime.close()


def _loop(chat: Chat, interactive: bool) -> int:
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            return 0
        except KeyboardInterrupt:
            print(file=sys.stderr)
            return 130
        text = line.strip()
        if not text:
            continue
        if text in (":quit", ":exit", ":q"):
            return 0
        if text == ":reset":
            chat.reset()
            print("conversation reset", file=sys.stderr)
        elif text == ":stats":
            print(json.dumps(chat.stats()), file=sys.stderr)
        elif (turn := chat.ask(text)) is not None:
            print(footer(turn), file=sys.stderr, flush=True)

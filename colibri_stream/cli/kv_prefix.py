"""`colibri-stream kv prefix|prefix-clear|export|import`: the model's shared prefix cache and KV packs."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from colibri_stream.checkpoint.fingerprint import model_fingerprint
from colibri_stream.cli.options import parse_ids
from colibri_stream.errors import RequestError
from colibri_stream.runtime.kv.packs import export_pack, import_pack, template_digest
from colibri_stream.runtime.kv.prefix_cache import PREFIX_DIR, PrefixCache
from colibri_stream.runtime.kv.sessions import default_kv_dir, session_state
from colibri_stream.text.chat_format import PromptEncoder, load_chat_format, load_tokenizer
from engine.config.args import ModelArgs
from storage.kv.log import RECORD_DTYPES
from storage.kv.pack import PACK_SUFFIX
from storage.kv.prefix_blocks import describe_blocks
from storage.kv.prefix_store import PrefixConfig, PrefixStore

ACTIONS = {
    "prefix": "show the shared prefix cache: blocks, tokens and bytes per state",
    "prefix-clear": "delete every block of the prefix cache",
    "export": "write the cached prefix of a prompt to a KV pack file",
    "import": "add a KV pack's prefix to the prefix cache",
}


def add_actions(actions: argparse._SubParsersAction, kv_dir_help: str, handler: Callable[..., int]) -> None:
    """The actions, run by ``handler`` (kv.py's: it reads the model's config first, then calls
    ``run_prefix_action``)."""
    for name, text in ACTIONS.items():
        action = actions.add_parser(name, help=text, description=text)
        action.add_argument("model", help="container or HF checkpoint directory")
        if name == "export":
            action.add_argument("pack", help=f"the pack file to write (e.g. preamble{PACK_SUFFIX})")
            source = action.add_mutually_exclusive_group(required=True)
            source.add_argument("--prompt-file", help="the prompt text (special tokens written out become theirs)")
            source.add_argument("--ids", type=parse_ids, help="the prompt as comma-separated token ids")
            action.add_argument("--name", help="the pack's name (default: the file's stem)")
            action.add_argument("--dtype", default="float32", help="compute dtype the prefix was cached in")
            action.add_argument("--activations", default="float32", choices=("float32", "int8"))
            action.add_argument("--kv-dtype", default="float32", choices=RECORD_DTYPES, help="record dtype")
        if name == "import":
            action.add_argument("pack", help="a KV pack written by `kv export` for this model")
        action.add_argument("--kv-dir", help=kv_dir_help)
        action.add_argument("--json", action="store_true", help="JSON output")
        action.set_defaults(handler=handler)


def run_prefix_action(args: argparse.Namespace, model_args: ModelArgs) -> int:
    fingerprint = model_fingerprint(args.model)
    kv_dir = Path(args.kv_dir) if args.kv_dir else default_kv_dir(fingerprint)
    if args.kv_command == "prefix":
        groups = describe_blocks(kv_dir / PREFIX_DIR)
        print(json.dumps(groups) if args.json else "\n".join(_line(g) for g in groups) or "prefix cache is empty")
        return 0
    if args.kv_command == "prefix-clear":
        removed = PrefixStore.clear_directory(kv_dir / PREFIX_DIR)
        print(json.dumps({"removed_blocks": removed}) if args.json else f"removed {removed} prefix block(s)")
        return 0
    template = _template_digest(args.model)
    if args.kv_command == "import":
        imported = import_pack(kv_dir, fingerprint, model_args, template, Path(args.pack), PrefixConfig())
        result = {"pack": imported.name, "positions": imported.positions, "blocks_added": imported.blocks_added}
        print(json.dumps(result) if args.json else f"imported {imported.name!r}: {imported.positions} tokens")
        return 0
    state = session_state(args.dtype, args.activations)
    prefix = PrefixCache.open(kv_dir, fingerprint, model_args, args.kv_dtype, state, PrefixConfig())
    name = args.name or Path(args.pack).stem
    positions = export_pack(prefix, _prompt_ids(args), Path(args.pack), name, template)
    print(
        json.dumps({"pack": name, "positions": positions}) if args.json else f"wrote {positions} tokens to {args.pack}"
    )
    return 0


def _line(group: dict[str, object]) -> str:
    return f"{group['state']}\t{group['blocks']} blocks\t{group['tokens']} tokens\t{group['bytes']} bytes"


def _template_digest(model: str) -> str:
    chat = load_chat_format(model)
    return template_digest(chat.template, chat.bos_token, chat.eos_token)


def _prompt_ids(args: argparse.Namespace) -> list[int]:
    if args.ids is not None:
        return list(args.ids)
    try:
        text = Path(args.prompt_file).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise RequestError(f"{args.prompt_file}: cannot read the prompt file ({exc})") from None
    return PromptEncoder(load_tokenizer(args.model)).encode(text)

"""`colibri-stream kv prefix|prefix-clear|export|import`: the model's prefix cache and KV packs. An import
loads the model (in the pack's compute dtype and activation path) to check the pack's values against it
(runtime/kv/pack_checks.py)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from colibri_stream.checkpoint.dtypes import COMPUTE_DTYPES
from colibri_stream.checkpoint.fingerprint import model_fingerprint
from colibri_stream.cli.options import parse_ids
from colibri_stream.errors import RequestError, SessionError
from colibri_stream.planning.budget import StoreOptions
from colibri_stream.planning.kv_bytes import kv_geometry
from colibri_stream.runtime.kv.pack_checks import EXACT_TOLERANCE, LOSSY_TOLERANCE, Recompute
from colibri_stream.runtime.kv.packs import ImportOptions, export_pack, import_pack, template_digest
from colibri_stream.runtime.kv.prefix_cache import PREFIX_DIR, PrefixCache, tenant_of_key
from colibri_stream.runtime.kv.sessions import DEFAULT_ACTIVATIONS, default_kv_dir, session_state
from colibri_stream.runtime.turn import RuntimeOptions, load_runtime
from colibri_stream.text.chat_format import PromptEncoder, load_chat_format, load_tokenizer
from engine.config.args import ModelArgs
from storage.errors import FormatError
from storage.files.safe_read import decode_utf8, read_bounded
from storage.kv.log import RECORD_DTYPES
from storage.kv.pack import PACK_SUFFIX, read_pack_header
from storage.kv.prefix_blocks import describe_blocks
from storage.kv.prefix_store import PrefixConfig, PrefixStore

ACTIVATIONS = ("float32", "int8", "int8-tiles")  # runtime/loader.py ACTIVATIONS
MAX_VERIFY = 1 << 20  # positions; a pack is never near this long
MAX_KEY_FILE_BYTES = 1 << 16

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
            action.add_argument("--activations", default="float32", choices=ACTIVATIONS)
            action.add_argument("--kv-dtype", default="float32", choices=RECORD_DTYPES, help="record dtype")
        if name == "import":
            action.add_argument("pack", help="a KV pack written by `kv export` for this model")
            action.add_argument(
                "--verify",
                type=_count,
                default=0,
                metavar="N",
                help="also recompute the first N positions by prefill, and N drawn at random from the pack's own "
                "earlier positions, refusing a pack that disagrees (one filed under other tokens); default 0: "
                "values checked against the model's bounds only",
            )
            action.add_argument(
                "--verify-tolerance",
                type=_tolerance,
                metavar="X",
                help=f"the relative difference --verify allows (default {EXACT_TOLERANCE} for float32 compute, "
                f"{LOSSY_TOLERANCE} for bfloat16 or int8 activations)",
            )
        if name in ("import", "export"):
            action.add_argument(
                "--key-file",
                help="a file holding the API key whose prefix cache the pack goes into (import) or comes from "
                "(export), as `serve --api-key` keeps one per key; default: the namespace of a server without "
                "keys or with --shared-prefix-cache",
            )
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
    tenant = _tenant(args.key_file)
    if args.kv_command == "import":
        return _import(args, kv_dir, fingerprint, template, tenant)
    state = session_state(args.dtype, args.activations)
    prefix = PrefixCache.open(kv_dir, fingerprint, model_args, args.kv_dtype, state, PrefixConfig())
    name = args.name or Path(args.pack).stem
    positions = export_pack(prefix, _prompt_ids(args), Path(args.pack), name, template, tenant)
    print(
        json.dumps({"pack": name, "positions": positions}) if args.json else f"wrote {positions} tokens to {args.pack}"
    )
    return 0


def _import(args: argparse.Namespace, kv_dir: Path, fingerprint: str, template: str, tenant: str | None) -> int:
    path = Path(args.pack)
    header = read_pack_header(path)
    compute, activations = header.state.get("compute_dtype"), header.state.get("activations", DEFAULT_ACTIVATIONS)
    if (
        compute not in COMPUTE_DTYPES
        or activations not in ACTIVATIONS
        or header.state != session_state(compute, activations)
    ):
        raise SessionError(f"{path}: KV pack {header.name!r} was computed in a state this runtime has no such run for")
    options = RuntimeOptions(
        dtype=compute,
        activations=activations,
        store=StoreOptions(ram="auto"),
        kv_dir=kv_dir,
        text=False,
        prefix=PrefixConfig(enabled=False),  # the pack's blocks are written below, not by a turn
    )
    runtime = load_runtime(args.model, options)
    try:
        if session_state(runtime.kv.compute_dtype, runtime.kv.activations) != header.state:
            raise SessionError(f"{path}: KV pack {header.name!r} was computed on a path this model cannot run")
        lossy = compute != "float32" or activations != DEFAULT_ACTIVATIONS
        geometry = kv_geometry(runtime.loaded.args, header.geometry.dtype)
        loaded = runtime.loaded
        recompute = Recompute(loaded.model, loaded.experts, loaded.args, geometry, lossy)
        checks = ImportOptions(tenant, args.verify, args.verify_tolerance)
        imported = import_pack(kv_dir, fingerprint, template, path, PrefixConfig(), recompute, checks)
    finally:
        runtime.close()
    result = {"pack": imported.name, "positions": imported.positions, "blocks_added": imported.blocks_added}
    print(json.dumps(result) if args.json else f"imported {imported.name!r}: {imported.positions} tokens")
    return 0


def _tenant(key_file: str | None) -> str | None:
    """The tenant of the API key in ``key_file`` (its first line); None without one."""
    if key_file is None:
        return None
    try:
        key = decode_utf8(read_bounded(Path(key_file), MAX_KEY_FILE_BYTES, "key file"), key_file, "key file")
    except (OSError, FormatError) as exc:
        raise RequestError(f"--key-file {key_file}: cannot read the key ({exc})") from None
    lines = key.strip().splitlines()
    if not lines or not lines[0].strip():
        raise RequestError(f"--key-file {key_file}: holds no key")
    return tenant_of_key(lines[0].strip().encode())


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not 0 <= value <= MAX_VERIFY:
        raise argparse.ArgumentTypeError(f"must be 0..{MAX_VERIFY}, got {value}")
    return value


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value < 10:  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be above 0 and below 10, got {text}")
    return value


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

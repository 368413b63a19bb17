"""llama.cpp as a contender of `colibri-stream bench`: its converter, set up once, and the two GGUF files.

The bench's HF checkpoint is converted with llama.cpp's own `convert_hf_to_gguf.py` (bf16, lossless),
then quantized twice with llama.cpp's C quantizer (`llama_model_quantize` through llama-cpp-python):

- ``q4_0``: the default Q4_0 recipe, what users download (llama.cpp keeps a few tensors, such as the
  output head, in a wider type of its choosing);
- ``q4e_q8``: quality-matched to ours: the routed-expert tensors (``*_exps``) Q4_0, every other
  quantizable tensor Q8_0 (``pure`` plus one tensor-type override, llama-quantize's ``--tensor-type``).

pip installs llama-cpp-python without the converter, so `colibri-stream bench --setup-peers` (or
``python -m colibri_stream.bench.llama_cpp setup [SDIST]``) extracts it, with its ``conversion``
package and its own gguf-py, from the llama-cpp-python sdist into ~/.cache/colibri-stream/peers/llama.cpp.

The generated model has no tokenizer; the converter needs one, so a byte-level BPE is written next to a
linked view of the checkpoint, and its pre-tokenizer (whose hash llama.cpp cannot know) is declared
"default". The bench feeds token ids, so tokenization never runs.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import importlib.util
import json
import re
import runpy
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

from colibri_stream.errors import ColibriError
from colibri_stream.paths import user_cache_dir

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"  # the version the peers extra pins; its sdist holds the converter
# what the converter needs from the sdist (paths under vendor/llama.cpp/)
CONVERTER_FILES = re.compile(
    r"^[^/]+/vendor/llama\.cpp/(LICENSE|convert_hf_to_gguf\.py|conversion/.+|gguf-py/gguf/.+)$"
)
EXPERT_TENSOR = r"_exps\.weight$"  # llama.cpp's names of the routed experts' 3-D tensors (ffn_{gate,up,down}_exps)
GGML_TYPE_Q4_0 = 2  # ggml.h
FILE_KINDS = ("q4e_q8", "q4_0")  # quality-matched first: the ratios are taken against it
# each file -> our container computed as it is (int4 experts, int8 activations; int8 / int4 dense records)
MATCHED_CONTAINERS = {"q4e_q8": "int4-int8dense", "q4_0": "int4-int4dense"}
SETUP_COMMAND = "pip install 'colibri-stream[peers]' && colibri-stream bench --setup-peers"


class PeerSetupError(ColibriError):
    """The llama.cpp converter could not be set up or run; the message says which step and file."""


def default_llama_cpp_dir() -> Path:
    return user_cache_dir("peers", "llama.cpp")


def skip_reason(llama_cpp_dir: Path) -> str | None:
    """None when llama.cpp can run here; else the one line the report prints instead of the section."""
    missing = [name for name in ("llama_cpp", "gguf") if importlib.util.find_spec(name) is None]
    if missing:
        return f"llama.cpp section skipped: {' and '.join(missing)} not installed (run: {SETUP_COMMAND})"
    if not (llama_cpp_dir / "convert_hf_to_gguf.py").is_file():
        return (
            f"llama.cpp section skipped: no llama.cpp converter in {llama_cpp_dir} "
            f"(run once: colibri-stream bench --setup-peers)"
        )
    return None


# ------------------------------------------------------------------------------------------- setup
def setup_converter(dest: Path, sdist: Path | None = None, log: Callable[[str], None] = print) -> Path:
    """Extract the converter from ``sdist`` (downloaded from the package index when None) into ``dest``."""
    with tempfile.TemporaryDirectory() as tmp:
        if sdist is None:
            log(f"downloading the {LLAMA_CPP_PYTHON} sdist (it holds llama.cpp's converter)")
            sdist = _download_sdist(Path(tmp))
        extracted = extract_converter(sdist, dest)
    log(f"llama.cpp converter: {extracted} files from {sdist.name} in {dest}")
    return dest


def _download_sdist(into: Path) -> Path:
    argv = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", LLAMA_CPP_PYTHON]
    done = subprocess.run([*argv, "-d", str(into)], capture_output=True, text=True)
    found = sorted(into.glob("llama_cpp_python-*.tar.gz"))
    if done.returncode != 0 or not found:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise PeerSetupError(f"pip download {LLAMA_CPP_PYTHON} failed: {tail}")
    return found[0]


def extract_converter(sdist: Path, dest: Path) -> int:
    """Copy the converter's files (and nothing else) out of the sdist; returns how many."""
    try:
        archive = tarfile.open(sdist)
    except (OSError, tarfile.TarError) as exc:
        raise PeerSetupError(f"{sdist}: not a readable sdist ({exc})") from None
    count = 0
    with archive:
        for member in archive.getmembers():
            match = CONVERTER_FILES.match(member.name)
            if not match or not member.isfile() or ".." in Path(match.group(1)).parts:
                continue
            target = dest / match.group(1)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(archive.extractfile(member).read())  # type: ignore[union-attr]  # a regular file
            count += 1
    if not (dest / "convert_hf_to_gguf.py").is_file():
        raise PeerSetupError(f"{sdist}: no vendor/llama.cpp/convert_hf_to_gguf.py in this sdist")
    (dest / "SOURCE").write_text(sdist.name + "\n")
    return count


# ------------------------------------------------------------------------------------ the GGUF files
def checkpoint_key(hf: Path) -> str:
    """Names the GGUF files after what they were converted from: config + every shard's name and size."""
    digest = hashlib.sha256((hf / "config.json").read_bytes())
    for shard in sorted(hf.glob("*.safetensors")):
        digest.update(f"{shard.name}:{shard.stat().st_size}:{shard.stat().st_mtime_ns}".encode())
    return digest.hexdigest()[:12]


def prepare_gguf_files(
    hf: Path, work: Path, llama_cpp_dir: Path, threads: int, log: Callable[[str], None], progress: bool
) -> dict[str, Path]:
    """Both quantized files for ``hf``, converted once and cached in ``work``/llama.cpp/<key>/."""
    folder = work / "llama.cpp" / checkpoint_key(hf)
    files = {kind: folder / f"{kind}.gguf" for kind in FILE_KINDS}
    if all(path.is_file() for path in files.values()):
        return files
    shutil.rmtree(work / "llama.cpp", ignore_errors=True)  # files of an older checkpoint: gigabytes
    folder.mkdir(parents=True)
    view = write_checkpoint_view(hf, folder / "hf-view")
    bf16 = folder / "bf16.gguf"
    log(f"llama.cpp: converting {hf} with convert_hf_to_gguf.py (bf16)")
    _child(["convert", "--llama-cpp-dir", str(llama_cpp_dir), str(view), str(bf16)], progress)
    for i, (kind, path) in enumerate(files.items(), 1):
        log(f"llama.cpp: quantizing {kind} ({i}/{len(files)})")
        partial = path.with_suffix(".partial")
        _child(["quantize", str(bf16), str(partial), kind, "--threads", str(threads)], progress=False)
        partial.rename(path)
    bf16.unlink()
    shutil.rmtree(view)
    return files


def _child(args: list[str], progress: bool) -> None:
    argv = [sys.executable, "-m", "colibri_stream.bench.llama_cpp", *args]
    done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=None if progress else subprocess.PIPE, text=True)
    if done.returncode != 0:
        tail = ((done.stderr or "").strip().splitlines() or ["(see its output above)"])[-1]
        raise PeerSetupError(f"python -m colibri_stream.bench.llama_cpp {' '.join(args)} failed: {tail}")


def write_checkpoint_view(hf: Path, view: Path) -> Path:
    """A folder of links to ``hf``'s files plus a tokenizer, so the bench's own checkpoint stays as it is."""
    shutil.rmtree(view, ignore_errors=True)
    view.mkdir(parents=True)
    for path in hf.iterdir():
        if path.suffix in (".json", ".safetensors") and not path.name.startswith("tokenizer"):
            (view / path.name).symlink_to(path.resolve())
    config = json.loads((hf / "config.json").read_text())
    if not (hf / "tokenizer.json").is_file():
        write_byte_tokenizer(view, config["vocab_size"], config.get("bos_token_id", 0), config.get("eos_token_id", 1))
    else:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if (hf / name).is_file():
                (view / name).symlink_to((hf / name).resolve())
    return view


def write_byte_tokenizer(folder: Path, vocab_size: int, bos_id: int, eos_id: int) -> None:
    """A deterministic byte-level BPE: two specials, the 256 byte symbols, two merges (llama.cpp's BPE
    loader requires merges), every other id of the model's vocabulary unused."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = {"<|bos|>": bos_id, "<|eos|>": eos_id}
    merges = [("Ġ", "t"), ("h", "e")]
    symbols = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["".join(pair) for pair in merges]
    free = [i for i in range(vocab_size) if i not in specials.values()]
    if len(free) < len(symbols) or max(specials.values()) >= vocab_size:
        raise PeerSetupError(f"{folder}: a vocabulary of {vocab_size} ids cannot hold the {len(symbols) + 2} tokens")
    vocab = {**specials, **dict(zip(symbols, free, strict=False))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(specials))
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>", "eos_token": "<|eos|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")


# ------------------------------------------------------------------------- child process commands
def run_converter(llama_cpp_dir: Path, hf: Path, out: Path) -> None:
    """llama.cpp's convert_hf_to_gguf.py as its own __main__, with its vendored gguf-py, in this process."""
    converter = llama_cpp_dir / "convert_hf_to_gguf.py"
    sys.path[:0] = [str(llama_cpp_dir), str(llama_cpp_dir / "gguf-py")]  # its gguf-py, not pip's older gguf
    from conversion import base  # type: ignore[import-not-found]  # the converter's own package, from llama_cpp_dir

    recognised = base.TextModel.get_vocab_base_pre

    def default_when_unknown(self, tokenizer) -> str:
        try:
            return recognised(self, tokenizer)
        except NotImplementedError:  # the generated byte-level tokenizer: no known hash
            return "default"

    base.TextModel.get_vocab_base_pre = default_when_unknown
    sys.argv = [str(converter), str(hf), "--outtype", "bf16", "--outfile", str(out)]
    runpy.run_path(str(converter), run_name="__main__")


def quantize_params(kind: str, threads: int):
    """llama_model_quantize_params for one of FILE_KINDS (the override array is kept alive on the params)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = threads
    if kind == "q4_0":
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
    elif kind == "q4e_q8":
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
        params.pure = True  # every quantizable tensor Q8_0, output and embeddings included ...
        overrides = (llama_cpp.llama_model_tensor_override * 2)()
        overrides[0].pattern, overrides[0].type = EXPERT_TENSOR.encode(), GGML_TYPE_Q4_0  # ... but the experts
        overrides[1].pattern = None  # the list ends with a null pattern
        params.tt_overrides = ctypes.cast(overrides, ctypes.POINTER(llama_cpp.llama_model_tensor_override))
        params._overrides = overrides
    else:
        raise ValueError(f"unknown GGUF kind {kind!r}: one of {FILE_KINDS}")
    return params


def run_quantize(src: Path, dst: Path, kind: str, threads: int) -> None:
    import llama_cpp

    params = quantize_params(kind, threads)
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) != 0:
        raise PeerSetupError(f"llama_model_quantize {src} -> {dst} ({kind}) failed")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m colibri_stream.bench.llama_cpp", description=__doc__.split("\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    setup = commands.add_parser("setup", help="extract llama.cpp's converter from the llama-cpp-python sdist")
    setup.add_argument("sdist", nargs="?", type=Path, help="a downloaded sdist (default: pip download it)")
    setup.add_argument("--llama-cpp-dir", type=Path, default=default_llama_cpp_dir())
    convert = commands.add_parser("convert", help="HF checkpoint -> bf16 GGUF with llama.cpp's converter")
    convert.add_argument("--llama-cpp-dir", type=Path, default=default_llama_cpp_dir())
    convert.add_argument("hf", type=Path)
    convert.add_argument("out", type=Path)
    quantize = commands.add_parser("quantize", help="bf16 GGUF -> one of the bench's quantized files")
    quantize.add_argument("src", type=Path)
    quantize.add_argument("dst", type=Path)
    quantize.add_argument("kind", choices=FILE_KINDS)
    quantize.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    try:
        if args.command == "setup":
            setup_converter(args.llama_cpp_dir, args.sdist)
        elif args.command == "convert":
            run_converter(args.llama_cpp_dir, args.hf, args.out)
        else:
            run_quantize(args.src, args.dst, args.kind, args.threads)
    except ColibriError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

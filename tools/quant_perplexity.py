"""Held-out perplexity of the demo model under every expert record kind, vs its float weights.

    python tools/quant_perplexity.py          # markdown table for docs/quantization.md (~3 min on 2 cores)

Variants: our int4 at group 64 (the default) and 32; the experts quantised by compressed-tensors'
own compressor (pack-quantized int4 g32, as Kimi-K2-Thinking ships; MXFP4) and copied into records as
shipped. Dense weights bf16 (convert's default), except the int8 / int4 rows: dense int8 or int4 records
(`convert --dense`) and/or int8 activations (engine/kernels/q8.py); the float row runs the checkpoint directory
itself in float32. Same 64 windows x 256 held-out tokens as colibri_stream/demo_model/README.md.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from colibri_stream.checkpoint.demo_model import demo_model_dir
from colibri_stream.convert.converter import Converter, ConvertOptions
from colibri_stream.devtools.quantized_fixtures import build_quantized_checkpoint
from colibri_stream.devtools.train_demo import engine_perplexity, heldout_windows
from colibri_stream.runtime.loader import load_checkpoint, load_container
from engine.kernels.modes import prompt_rows
from storage.container.reader import Container

DEMO = demo_model_dir()


def variants(root: Path) -> list[tuple[str, Path]]:
    """(label, container) for every record kind, converted from the demo checkpoint."""
    made = []
    for group in (64, 32):
        dst = root / f"int4-g{group}"
        Converter(DEMO, dst, ConvertOptions(experts="int4", group_size=group, mtp=False), progress=False).run()
        made.append((f"int4 g{group} (our quantiser)", dst))
    for fmt in ("pack-quantized", "mxfp4-pack-quantized"):
        source = build_quantized_checkpoint(DEMO, root / f"src-{fmt}", fmt=fmt, group_size=32)
        dst = root / fmt
        Converter(source, dst, ConvertOptions(mtp=False), progress=False).run()
        made.append((f"compressed-tensors {fmt} g32, copied as shipped", dst))
    return made


def int8_variants(root: Path) -> list[tuple[str, Path, str]]:
    """(label, container, activations): the int8 and int4 dense choices and int8 activations on int4 g64
    experts, each alone and together (dense int8 + activations: quality-matched to llama.cpp's Q4_0 experts +
    Q8_0 rest; dense int4 + activations: its all-Q4_0 file), and those two with the prompts as tile GEMMs."""
    coded = {}
    for dense in ("int8", "int4"):
        coded[dense] = root / f"int4-g64-dense-{dense}"
        Converter(
            DEMO, coded[dense], ConvertOptions(experts="int4", group_size=64, dense=dense, mtp=False), progress=False
        ).run()
    tiles = " (`--activations int8-tiles`: each window a prompt of tile GEMMs)"
    return [
        ("int4 g64, dense int8 records", coded["int8"], "float32"),
        ("int4 g64, int8 activations", root / "int4-g64", "int8"),
        ("int4 g64, dense int8 + int8 activations", coded["int8"], "int8"),
        ("int4 g64, dense int8 + int8 activations" + tiles, coded["int8"], "int8-tiles"),
        ("int4 g64, dense int4 records", coded["int4"], "float32"),
        ("int4 g64, dense int4 + int8 activations (as llama.cpp's all-Q4_0)", coded["int4"], "int8"),
        ("int4 g64, dense int4 + int8 activations" + tiles, coded["int4"], "int8-tiles"),
    ]


def main() -> None:
    windows = heldout_windows(DEMO)
    reference = engine_perplexity(load_checkpoint(DEMO), windows)
    print("| experts | record kind | held-out perplexity | vs float |\n|---|---|---|---|")
    print(f"| float32 (checkpoint) | - | {reference:.3f} | - |")
    with tempfile.TemporaryDirectory() as tmp:
        rows = [(label, path, "float32") for label, path in variants(Path(tmp))] + int8_variants(Path(tmp))
        for label, path, activations in rows:
            with prompt_rows(activations == "int8-tiles"):  # the plain C loop's bytes where the CPU lacks VNNI
                ppl = engine_perplexity(load_container(path, int8_activations=activations != "float32"), windows)
            kind = Container(path).layout.scheme
            print(f"| {label} | {kind} | {ppl:.3f} | {100 * (ppl / reference - 1):+.2f}% |", flush=True)


if __name__ == "__main__":
    main()

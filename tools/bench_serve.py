"""Aggregate tok/s of `serve` for 1/2/4/8 concurrent clients, against the same requests sent one after
another, measured side by side in one run (a benchmark, not a test; `colibri-stream bench --sections batch`
takes the same rows on the demo model).

    python tools/bench_serve.py [--model demo|stress|PATH] [--ram 25%] [--clients 1,2,4,8] [--rounds 3]
                                [--max-tokens 32] [--stress-layers 8] [--work DIR] [--json FILE]
                                [--dense int8|int4 --activations int8]

The model is converted once into --work (the demo model, or the generated DeepSeek-V3-shaped stress
model of colibri_stream/bench/stress_model.py with --stress-layers layers) and served by `colibri-stream
serve` in a child process; colibri_stream/bench/batch_rows.py says how each row is measured (rounds of
sequential, concurrent, concurrent, sequential; the median round's ratio) and checks that batching changes
no answer.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from colibri_stream.bench.batch_rows import BatchSettings, batch_section, batch_table
from colibri_stream.bench.stress_model import StressShape, write_stress_checkpoint
from colibri_stream.checkpoint.demo_model import demo_model_dir
from colibri_stream.convert.converter import Converter, ConvertOptions
from colibri_stream.devtools.fixtures import write_tiny_tokenizer
from colibri_stream.planning.geometry import DEFAULT_DENSE
from storage.container.reader import is_container


def container_for(
    model: str, work: Path, stress_layers: int, stress_context: int = 4096, dense: str = DEFAULT_DENSE
) -> Path:
    """The container to serve ("demo", "stress" or a path), converted into ``work`` once (kept for later
    runs) with ``dense`` records. The stress model has no tokenizer: a tiny one is trained so the server can
    decode text."""
    if model not in ("demo", "stress"):
        return Path(model)
    name = f"stress-{stress_layers}-{stress_context}" if model == "stress" else "demo"
    dst = work / (f"{name}.cstream" if dense == DEFAULT_DENSE else f"{name}-{dense}.cstream")
    if not is_container(dst):
        if model == "demo":
            source = demo_model_dir()
        else:
            shape = dataclasses.replace(
                StressShape(), num_hidden_layers=stress_layers, max_position_embeddings=stress_context
            )
            source = write_stress_checkpoint(work / f"{name}-hf", shape)
        Converter(source, dst, ConvertOptions(dense=dense)).run()
    if not (dst / "tokenizer.json").exists():
        write_tiny_tokenizer(dst, json.loads((dst / "config.json").read_text())["vocab_size"])
    return dst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo", help="demo, stress or a container path (default demo)")
    parser.add_argument("--ram", default="25%", help="RAM budget for expert slots (default 25%%)")
    parser.add_argument("--clients", default="1,2,4,8", help="concurrent client counts (default 1,2,4,8)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per client count; the median counts")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=24)
    parser.add_argument("--stress-layers", type=int, default=8, help="layers of the stress model (default 8)")
    parser.add_argument("--work", default=str(Path.home() / ".cache" / "colibri-stream" / "bench-serve"))
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument(
        "--dense", default=DEFAULT_DENSE, help="the dense records converted (int8, int4: the int8 path)"
    )
    parser.add_argument("--activations", default="float32", choices=["float32", "int8"])
    args = parser.parse_args()
    clients = [int(n) for n in args.clients.split(",")]
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    container = container_for(args.model, work, args.stress_layers, dense=args.dense)
    settings = BatchSettings(
        tuple(clients), args.max_tokens, args.prompt_tokens, args.rounds, args.ram, args.activations
    )
    print(
        f"{args.model} at --ram {args.ram}, dense {args.dense}, {args.activations} activations: "
        f"{args.max_tokens} tokens per request, {args.rounds} rounds",
        file=sys.stderr,
    )
    section = batch_section(container, work / "kv", settings)
    print("\n".join(batch_table(section)))
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model} | section, indent=2))


if __name__ == "__main__":
    main()

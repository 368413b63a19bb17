"""The bench's MTP rows alone: the demo model's trained MTP drafts, plain vs governor vs forced on, at
100% and 25% RAM, one fresh process each (colibri_stream/bench/mtp_rows.py), and the table.

    python tools/bench_mtp.py --work /tmp/mtp-bench [--tokens 256] [--depth 2] [--int8] [--json out.json]

--int8: the int8 path (a `--dense int8` container run with `--activations int8`), where a resident step is
one C call and the MTP block's drafts are too (engine/mla/fused_decode.py); without it the default exact path.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from colibri_stream.bench.mtp_rows import mtp_section, mtp_table
from colibri_stream.bench.system import convert
from colibri_stream.checkpoint.demo_model import DEMO_PROMPT, demo_container_path, demo_model_dir
from storage.container.reader import Container

GiB = 1 << 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True, help="where the demo container and KV files go")
    parser.add_argument("--tokens", type=int, default=256, help="tokens generated per run (the full bench's count)")
    parser.add_argument("--depth", type=int, default=2, help="--mtp-depth of the drafting runs")
    parser.add_argument("--prompt", default=DEMO_PROMPT)
    parser.add_argument("--repeats", type=int, default=3, help="runs per row (the median is kept)")
    parser.add_argument("--int8", action="store_true", help="the int8 path: --dense int8, --activations int8")
    parser.add_argument("--json", type=Path, help="also write the section as JSON here")
    args = parser.parse_args()
    model_dir = demo_model_dir()
    dense, folder = ("int8", "demo-int8") if args.int8 else ("bf16", "demo")
    demo = convert(model_dir, demo_container_path(model_dir, args.work / folder), dense=dense)
    limit = Container(demo).expert_bytes + GiB
    extra = ("--activations", "int8") if args.int8 else ()
    section = mtp_section(
        demo, args.prompt, args.tokens, args.work / "kv", limit, 600.0, args.depth, args.repeats, extra
    )
    print("\n".join(mtp_table(section)))
    print(f"ratios: {section['ratios']}  same tokens: {section['same_tokens']}")
    if args.json:
        args.json.write_text(json.dumps(section, indent=2))


if __name__ == "__main__":
    main()

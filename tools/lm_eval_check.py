"""lm-evaluation-harness (`lm_eval`, its local-completions model) scoring `colibri-stream serve` on the
demo model, a float and an int4 container side by side, against the engine's own numbers.

    HF_DATASETS_OFFLINE=1 python tools/lm_eval_check.py            # ~40 held-out stdlib pieces, a few minutes
    python tools/lm_eval_check.py --docs 10 --max-chars 800         # quicker

Per container: lm-eval's word perplexity of a loglikelihood_rolling task over held-out stdlib text
(pieces of modules the demo model never saw, one window each), the same computed from the engine's
logits with no server between (they must agree to float noise), lm-eval's byte perplexity, the engine's
token perplexity on those pieces, and the project's own held-out perplexity (64 x 256-token windows,
what colibri_stream/demo_model/README.md and tools/quant_perplexity.py report). The float container
holds the checkpoint's bf16 experts as they are (lossless); the int4 one is what `demo` streams.
Logic: colibri_stream/devtools/lm_eval_check.py.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from tokenizers import Tokenizer

from colibri_stream.checkpoint.demo_model import demo_model_dir
from colibri_stream.convert.converter import Converter, ConvertOptions
from colibri_stream.devtools.lm_eval_check import (
    engine_scores,
    lm_eval_scores,
    results_table,
    serve_command,
    text_pieces,
    write_task,
)
from colibri_stream.devtools.train_demo import engine_perplexity, heldout_texts, heldout_windows
from colibri_stream.runtime.loader import load_container

CONTAINERS = (
    ("float (bf16 experts as shipped)", ConvertOptions(experts="bf16")),
    ("int4 g64 (the demo's)", ConvertOptions()),
)
MODEL = "demo"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=40, help="held-out pieces to score (default 40)")
    parser.add_argument("--max-chars", type=int, default=1500, help="characters per piece (default 1500)")
    args = parser.parse_args()
    demo = demo_model_dir()
    tokenizer = Tokenizer.from_file(str(demo / "tokenizer.json"))
    bos = tokenizer.token_to_id("<bos>")  # lm-eval's prefix token: the tokenizer's bos_token
    documents = text_pieces(heldout_texts(), args.docs, args.max_chars)
    windows = heldout_windows(demo)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        task_dir = write_task(Path(tmp) / "task", documents)
        for i, (label, options) in enumerate(CONTAINERS):
            container = Path(tmp) / f"container-{i}"
            Converter(demo, container, options, progress=False).run()
            with serve_command(container, MODEL, Path(tmp) / f"kv-{i}") as base:
                scored = lm_eval_scores(f"{base}/v1/completions", MODEL, demo, task_dir, max_length=2048)
            loaded = load_container(container)
            own = engine_scores(loaded, tokenizer, documents, bos)
            rows.append((label, scored, own, engine_perplexity(loaded, windows)))
            loaded.experts.close()
    tokens = rows[0][2].tokens
    print(f"{len(documents)} held-out pieces, {tokens} tokens, {rows[0][2].words} words (lm-eval's count)\n")
    print(results_table(rows))


if __name__ == "__main__":
    main()

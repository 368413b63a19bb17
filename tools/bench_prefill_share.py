"""The decode rate of a row batched beside a long prefill, before and after the decode share (a benchmark,
not a test; runtime/batching.py DECODE_SHARE).

    python tools/bench_prefill_share.py [--model demo|PATH] [--prompt-tokens 10000] [--json FILE]

One process, side by side on the same loaded model: the row decodes alone (its rate alone), then beside a
``--prompt-tokens`` prompt with DECODE_SHARE 0 (before: one decode pass per prompt chunk) and with the
shipped DECODE_SHARE. Reported per phase: the row's tokens/s while the prompt is read, the prompt's
prefill time, and the row's tokens (identical in every phase: checked).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from colibri_stream.checkpoint.demo_model import demo_model_dir
from colibri_stream.devtools.fixtures import make_prompt
from colibri_stream.runtime import batching
from colibri_stream.runtime.batching import ContinuousBatch, GenerationRequest
from colibri_stream.runtime.loader import load_checkpoint

ROW_PROMPT = [5, 9, 13, 2, 7]


def phase(loaded, prompt: list[int], share: float | None, row_tokens: int) -> dict:
    """The row decoding (beside ``prompt`` unless None) with DECODE_SHARE ``share``: its rate while the prompt
    is read and the prefill's time."""
    if share is not None:
        batching.DECODE_SHARE = share
    batch = ContinuousBatch(loaded.model, loaded.experts)
    row = batch.add(GenerationRequest(ROW_PROMPT, row_tokens))
    batch.step()  # the row's prompt and first token
    start, tokens_before = time.perf_counter(), len(row.result.ids)
    reader = batch.add(GenerationRequest(prompt, 1)) if prompt else None
    while (reader is not None and not reader.done) or (reader is None and len(row.result.ids) < 64):
        batch.step()
        if row.done:
            raise SystemExit("the row finished before the prompt was read: raise --row-tokens")
    elapsed = time.perf_counter() - start
    decoded = len(row.result.ids) - tokens_before
    while batch:
        batch.step()
    return {"row_tok_per_s": round(decoded / elapsed, 2), "prefill_s": round(elapsed, 2), "ids": row.result.ids}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo", help="demo or a checkpoint/container path (default demo)")
    parser.add_argument("--prompt-tokens", type=int, default=10000)
    parser.add_argument("--row-tokens", type=int, default=4000, help="the decoding row's max tokens")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    path = demo_model_dir() if args.model == "demo" else Path(args.model)
    loaded = load_checkpoint(path)
    shipped = batching.DECODE_SHARE
    vocab = loaded.model.args.vocab_size
    prompt = make_prompt(vocab, args.prompt_tokens, seed=3)
    results = {
        "alone": phase(loaded, [], None, args.row_tokens),
        "before (share 0)": phase(loaded, prompt, 0.0, args.row_tokens),
        f"after (share {shipped})": phase(loaded, prompt, shipped, args.row_tokens),
    }
    batching.DECODE_SHARE = shipped
    ids = [r.pop("ids") for r in results.values()]
    n = min(len(i) for i in ids)
    assert all(i[:n] == ids[0][:n] for i in ids), "the row's tokens changed"
    print(f"{args.model}: a row decoding beside a {args.prompt_tokens}-token prompt")
    print("| phase | row tok/s | prefill s |\n|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['row_tok_per_s']} | {r['prefill_s'] if name != 'alone' else '-'} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "prompt_tokens": args.prompt_tokens} | results))


if __name__ == "__main__":
    main()

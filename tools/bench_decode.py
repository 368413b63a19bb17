"""Decode tok/s of our float path vs transformers on a tiny fixture, measured side by side in one run.

    python tools/bench_decode.py [--family glm_moe_dsa] [--tokens 64] [--repeats 3]

Both run greedy from the same prompt with a KV cache; the ratio is what to read (these machines are
noisy), each number is the best of --repeats runs.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from colibri_stream.devtools import fixtures
from colibri_stream.runtime.generate import generate
from colibri_stream.runtime.loader import load_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="glm_moe_dsa", choices=fixtures.FAMILIES)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = fixtures.build_tiny_checkpoint(args.family, f"{tmp}/{args.family}")
        ours, reference = load_checkpoint(path), fixtures.load_reference(path)
        prompt = fixtures.make_prompt(ours.args.vocab_size, 20)

        def ours_rate() -> float:
            return generate(ours.model, prompt, args.tokens, ours.experts).stats.decode_tok_per_s

        def reference_rate() -> float:
            # prefill + 1 token, then prefill + N tokens: the difference is N - 1 decode steps
            start = time.perf_counter()
            fixtures.oracle_greedy(reference, prompt, 1)
            first = time.perf_counter() - start
            start = time.perf_counter()
            fixtures.oracle_greedy(reference, prompt, args.tokens)
            return (args.tokens - 1) / (time.perf_counter() - start - first)

        ours_tps = max(ours_rate() for _ in range(args.repeats))
        ref_tps = max(reference_rate() for _ in range(args.repeats))
    print(
        json.dumps(
            {
                "family": args.family,
                "decode_tokens": args.tokens,
                "ours_decode_tok_per_s": round(ours_tps, 1),
                "transformers_decode_tok_per_s": round(ref_tps, 1),
                "ratio_ours_vs_transformers": round(ours_tps / ref_tps, 2),
            }
        )
    )


if __name__ == "__main__":
    main()

"""What an edited DeepSeek-V4 conversation costs with the lean session log (storage/kv/lean_log.py): the turn
restores the last snapshot at or before the edit and re-prefills the rest. Measured on the tiny V4
fixture (or a checkpoint given with --checkpoint), estimated for V4-Flash from its snapshot interval.

    python tools/bench_v4_cutback.py [--checkpoint DIR] [--tokens 160] [--json]

Per cut-back point: the positions restored, re-prefilled, and the seconds the restore and the prefill of
the edited prompt took, beside a restart that edits nothing (the log's end: nothing re-prefilled).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from colibri_stream.devtools import fixtures
from colibri_stream.planning.kv_bytes import cache_bytes_per_token, session_geometry
from colibri_stream.runtime.generate import generate
from colibri_stream.runtime.kv.sessions import Session
from colibri_stream.runtime.loader import load_checkpoint
from engine.config.args import ModelArgs

# DeepSeek-V4-Flash's dims (tests/test_colibri_stream/runtime/kv/test_v4_sessions.py FLASH holds the whole config).
FLASH_CONFIG = (
    Path(__file__).resolve().parents[1] / "tests" / "test_colibri_stream" / "runtime" / "kv" / "test_v4_sessions.py"
)


def _flash_args() -> ModelArgs:
    sys.path.insert(0, str(FLASH_CONFIG.parent))
    from test_v4_sessions import FLASH  # the transcribed hub config.json

    return ModelArgs.from_hf_config(FLASH)


def measure(checkpoint: Path, tokens: int) -> list[dict[str, float | int]]:
    loaded = load_checkpoint(checkpoint)
    prompt = fixtures.make_prompt(loaded.args.vocab_size, tokens, seed=3)
    rows = []
    with tempfile.TemporaryDirectory() as kv_dir:
        session = Session(kv_dir, "bench", "fp", loaded.args)
        every = session.geometry.snapshot_every
        start = session.start_turn(prompt, torch.float32)
        ids = prompt + generate(loaded.model, prompt, 1, loaded.experts, cache=start.cache).ids
        session.end_turn(start.cache, ids)
        session.close()
        log = Path(kv_dir) / "bench.kvlog"
        original = log.read_bytes()  # each edit starts from the same conversation
        logged = tokens  # the prompt's positions (the answer's one token was never run)
        for cut in [logged, *range(every, logged, every // 2), logged - 1]:
            log.write_bytes(original)
            session = Session(kv_dir, "bench", "fp", loaded.args)
            edited = ids[:cut] + [7] + ids[cut + 1 : logged] + [8] if cut < logged else ids[:logged] + [8]
            began = time.perf_counter()
            turn = session.start_turn(edited, torch.float32)
            restored = time.perf_counter()
            loaded.model(torch.tensor([edited[turn.reused_tokens :]]), turn.reused_tokens, turn.cache, loaded.experts)
            done = time.perf_counter()
            session.end_turn(turn.cache, edited)
            session.close()
            rows.append(
                {
                    "edit_at": cut,
                    "restored": turn.reused_tokens,
                    "re_prefilled": max(0, cut - turn.reused_tokens),
                    "prefilled": len(edited) - turn.reused_tokens,
                    "restore_s": round(restored - began, 4),
                    "prefill_s": round(done - restored, 4),
                    "snapshot_every": every,
                }
            )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, help="a DeepSeek-V4 checkpoint (default: the tiny fixture)")
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = args.checkpoint or fixtures.build_tiny_checkpoint("deepseek_v4", Path(tmp) / "v4")
        rows = measure(checkpoint, args.tokens)
    flash = _flash_args()
    estimate = {
        "flash_snapshot_every": session_geometry(flash, "bfloat16").snapshot_every,
        "flash_log_bytes_per_token_bf16": round(session_geometry(flash, "bfloat16").bytes_per_token, 1),
        "flash_in_memory_bytes_per_token_bf16": cache_bytes_per_token(flash, "bfloat16"),
        "flash_kept_snapshot_bytes_bf16": session_geometry(flash, "bfloat16").kept_snapshot_bytes,
        "flash_end_snapshot_bytes_max_bf16": session_geometry(flash, "bfloat16").end_snapshot_bytes,
    }
    if args.json:
        print(json.dumps({"fixture": rows, "flash": estimate}))
        return 0
    print("edit_at restored re_prefilled prefilled restore_s prefill_s")
    for row in rows:
        print(
            " ".join(
                str(row[k]) for k in ("edit_at", "restored", "re_prefilled", "prefilled", "restore_s", "prefill_s")
            )
        )
    print(json.dumps(estimate))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

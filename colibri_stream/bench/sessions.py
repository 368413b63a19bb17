"""Section 5 of the bench: resuming a long conversation from its KV log vs re-prefilling it.

Three fresh processes under the same memory limit and expert budget (the ratios' 25%):
  1. build: a ~2k-token conversation is prefilled once and its compressed KV appended to a session;
  2. warm: the next user turn (the conversation + the answer token + a few new tokens) resumes from
     the log: its time to first token is the log read plus the new tokens' prefill;
  3. cold: the same prompt with no session: the whole conversation is prefilled again.
The page cache is left warm for both 2 and 3, which favours the cold re-prefill (its expert reads
are cheaper), so the speed-up is if anything understated. The first generated token must agree.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from colibri_stream.bench.system import MemoryLimit, cli_argv


def random_prompt_ids(vocab_size: int, length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, vocab_size) for _ in range(length)]  # ids 0/1 are bos/eos in stress models


def _turn(
    container: Path, ids: list[int], ram: str, kv_dir: Path, session: str | None, limit: MemoryLimit, timeout_s: float
) -> dict:
    argv = cli_argv("run", str(container), "--ids", ",".join(map(str, ids)), "--max-new-tokens", "1")
    argv += ["--ram", ram, "--json", "--kv-dir", str(kv_dir), "--no-prefix-cache"]  # the log's path alone
    if session:
        argv += ["--session", session]
    return json.loads(limit.run(argv, timeout_s).last_json_line())


def sessions_section(
    container: Path,
    vocab_size: int,
    conversation_tokens: int,
    new_tokens: int,
    ram: str,
    kv_dir: Path,
    limit: MemoryLimit,
    timeout_s: float,
) -> dict:
    history = random_prompt_ids(vocab_size, conversation_tokens, seed=1)
    built = _turn(container, history, ram, kv_dir, "bench-resume", limit, timeout_s)
    follow_up = history + built["ids"] + random_prompt_ids(vocab_size, new_tokens, seed=2)
    warm = _turn(container, follow_up, ram, kv_dir, "bench-resume", limit, timeout_s)
    cold = _turn(container, follow_up, ram, kv_dir, None, limit, timeout_s)
    warm_ttft = warm["stats"]["kv_load_s"] + warm["stats"]["ttft_s"]
    cold_ttft = cold["stats"]["ttft_s"]
    return {
        "conversation_tokens": len(history),
        "follow_up_tokens": len(follow_up),
        "warm": {
            "reused_tokens": warm["stats"]["reused_tokens"],
            "prefill_tokens": warm["stats"]["prefill_tokens"],
            "kv_load_s": warm["stats"]["kv_load_s"],
            "prefill_s": warm["stats"]["ttft_s"],
            "ttft_s": round(warm_ttft, 6),
        },
        "cold": {"prefill_tokens": cold["stats"]["prefill_tokens"], "ttft_s": cold_ttft},
        "same_first_token": warm["ids"] == cold["ids"],
        "resume_speedup": round(cold_ttft / warm_ttft, 1),
        # The KV restore alone; the rest of the warm TTFT is the new tokens' prefill, mostly reading
        # their experts into a store that a fresh process starts empty.
        "kv_restore_vs_reprefill": round(cold_ttft / max(warm["stats"]["kv_load_s"], 1e-9), 1),
    }

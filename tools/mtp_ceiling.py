"""The most MTP drafting could gain on a model, from what its kernels cost: issue #40's ceiling.

    python tools/mtp_ceiling.py CONTAINER [--activations int8] [--prompt TEXT] [--calls 300]

Speculation gains only what extra rows share with the step they ride on. A drafting step of depth k costs
at least a plain step's time T1, plus the kernel time its k extra verify rows add (C[k+1] - C[1]), plus the
kernel time of its k drafts (D[k]); all Python around them would have to be free. It yields 1 + a + .. + a^k
tokens at acceptance a, so no implementation on this model and machine beats

    ceiling(k, a) = (1 + a + .. + a^k) x T1 / (T1 + C[k+1] - C[1] + D[k])

Measured in-process at 100% (experts resident) on the prompt's context after 40 plain tokens, medians
over ``--calls``: T1 (a whole plain step), C[r] (time inside engine/_kernels during a verify of r rows on one
cache), D[k] (the same during a draft of depth k from one pair), and the acceptance a of forced depth-1
drafting over ``--tokens`` greedy tokens. Prints each depth's ceiling at that a and at a = 1, and the
acceptance 1.3x (#40's row at 100%) would need at each depth even then.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from colibri_stream.checkpoint.demo_model import DEMO_PROMPT
from colibri_stream.devtools.steps import prefill
from colibri_stream.planning.budget import StoreOptions
from colibri_stream.runtime.batching import ContinuousBatch, GenerationRequest
from colibri_stream.runtime.loader import load
from colibri_stream.runtime.mtp_governor import MTPOptions
from colibri_stream.runtime.speculation import Speculation
from colibri_stream.text.chat_format import load_tokenizer
from engine.kernels import _kernels

GOAL = 1.3


class KernelClock:
    """Seconds spent inside engine/_kernels' functions (wrapped in place: every caller looks them up there)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        for name in dir(_kernels):
            function = getattr(_kernels, name)  # reflection: every function the C extension exports
            if callable(function) and not name.startswith("_") and not isinstance(function, type):
                setattr(_kernels, name, self._timed(function))

    def _timed(self, function: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started

        return timed

    def median(self, call: Callable[[], object], calls: int) -> tuple[float, float]:
        """(whole, inside the kernels) seconds of ``call``, medians."""
        whole, inside = [], []
        for _ in range(calls):
            self.seconds, started = 0.0, time.perf_counter()
            call()
            whole.append(time.perf_counter() - started)
            inside.append(self.seconds)
        return statistics.median(whole), statistics.median(inside)


def acceptance(loaded: Any, prompt_ids: list[int], tokens: int) -> float:
    """Accepted over drafted, greedy, drafting every step at depth 1."""
    speculation = Speculation(loaded.drafter, MTPOptions("on", 1))
    batch = ContinuousBatch(loaded.model, loaded.experts, speculation=speculation)
    batch.add(GenerationRequest(prompt_ids, tokens))
    while batch:
        batch.step()
    governor = speculation.governor
    return governor.accepted / max(1, governor.drafted)


def ceiling(depth: int, a: float, plain_s: float, extra_rows_s: float, drafts_s: float) -> float:
    return sum(a**j for j in range(depth + 1)) * plain_s / (plain_s + extra_rows_s + drafts_s)


def needed(depth: int, plain_s: float, extra_rows_s: float, drafts_s: float) -> float | None:
    """The least acceptance whose ceiling reaches GOAL at ``depth`` (None: not even a = 1)."""
    low, high = 0.0, 1.0
    if ceiling(depth, high, plain_s, extra_rows_s, drafts_s) < GOAL:
        return None
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (middle, high) if ceiling(depth, middle, plain_s, extra_rows_s, drafts_s) < GOAL else (low, middle)
    return high


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("container", help="a converted container with an MTP layer (the demo's: bench_mtp.py)")
    parser.add_argument("--activations", default="float32", choices=("float32", "int8"))
    parser.add_argument("--prompt", default=DEMO_PROMPT)
    parser.add_argument("--calls", type=int, default=300, help="timed calls per median")
    parser.add_argument("--tokens", type=int, default=96, help="greedy tokens the acceptance is measured over")
    parser.add_argument("--max-depth", type=int, default=3)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    loaded = load(args.container, store=StoreOptions(ram="100%", preload=True), activations=args.activations)
    model, experts = loaded.model, loaded.experts
    prompt_ids = [0, *load_tokenizer(args.container).encode(args.prompt).ids]
    a = acceptance(loaded, prompt_ids, args.tokens)
    clock = KernelClock()
    cache = model.new_cache()
    token = int(prefill(model, prompt_ids, cache, experts).argmax())
    hidden = []
    for _ in range(40):
        logits, rows = model.forward_rows_hidden([token], [cache], experts)
        hidden.append(rows[0])
        token = int(logits[0].argmax())
    length, pair = cache.length, torch.stack(hidden[-1:])

    def verify(rows: int) -> Callable[[], None]:
        def call() -> None:
            model.forward_rows_hidden([token] * rows, [cache] * rows, experts)
            cache.trim(length)

        return call

    steps = {rows: clock.median(verify(rows), args.calls) for rows in range(1, args.max_depth + 2)}
    draft_cache = model.new_draft_cache()
    drafts = {
        depth: clock.median(lambda d=depth: model.draft(pair, [token], length - 1, draft_cache, experts, d), args.calls)
        for depth in range(1, args.max_depth + 1)
    }
    plain_s = steps[1][0]
    print(f"{args.container} ({args.activations}), context {length}: acceptance at depth 1 {a:.3f}")
    for rows, (whole, inside) in steps.items():
        print(f"  verify of {rows} row(s): {whole * 1e6:.0f} us, {inside * 1e6:.0f} us of it in the kernels")
    for depth, (whole, inside) in drafts.items():
        print(f"  draft of depth {depth}: {whole * 1e6:.0f} us, {inside * 1e6:.0f} us of it in the kernels")
    print("| depth | ceiling at a | ceiling at a = 1 | acceptance 1.3x needs |")
    print("|---:|---:|---:|---:|")
    for depth in range(1, args.max_depth + 1):
        costs = (plain_s, steps[depth + 1][1] - steps[1][1], drafts[depth][1])
        need = needed(depth, *costs)
        shown = "out of reach" if need is None else f"{need:.3f}"
        print(f"| {depth} | {ceiling(depth, a, *costs):.3f} | {ceiling(depth, 1.0, *costs):.3f} | {shown} |")


if __name__ == "__main__":
    main()

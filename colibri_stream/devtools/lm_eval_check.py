"""A client no one here wrote scoring `serve`: lm-evaluation-harness's ``local-completions`` model
(token-id prompts, ``echo`` + ``logprobs`` + ``max_tokens: 1``) running a ``loglikelihood_rolling`` task
over local documents, and the same documents scored from the engine's own logits, no server between.

The task is a JSON-lines file and a task YAML written here (``dataset_path: json``: nothing is
downloaded; run with HF_DATASETS_OFFLINE=1). Documents fit one rolling window each (lm-eval scores a
document as ``[bos] + ids``, every token given those before it), so the engine side is one forward per
document and both sides score the same predictions. lm-eval is a dev dependency: imported only here.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from colibri_stream.runtime.loader import LoadedModel

TASK = "colibri_heldout"
METRICS = ("word_perplexity", "byte_perplexity", "bits_per_byte")
START_WAIT_S = 300.0


@dataclass(frozen=True)
class Scores:
    """Perplexities of documents from their total log-likelihood, as lm-eval aggregates them."""

    loglikelihood: float
    words: int  # lm-eval's count: len(re.split(r"\\s+", doc)) per document
    bytes: int
    tokens: int

    @property
    def word_perplexity(self) -> float:
        return math.exp(-self.loglikelihood / self.words)

    @property
    def byte_perplexity(self) -> float:
        return math.exp(-self.loglikelihood / self.bytes)

    @property
    def token_perplexity(self) -> float:
        return math.exp(-self.loglikelihood / self.tokens)


def text_pieces(texts: Sequence[str], count: int, max_chars: int) -> list[str]:
    """The first ``count`` pieces of ``texts``: runs of whole lines up to ``max_chars`` characters,
    stripped, non-empty (each fits one window of the demo model's 2048 positions)."""
    pieces: list[str] = []
    for text in texts:
        run = ""
        for line in text.splitlines(keepends=True):
            if run and len(run) + len(line) > max_chars:
                pieces.append(run.strip())
                run = ""
            run += line[:max_chars]
        pieces.append(run.strip())
        pieces = [p for p in pieces if p]
        if len(pieces) >= count:
            break
    return pieces[:count]


def write_task(directory: Path, documents: Sequence[str], task: str = TASK) -> Path:
    """A loglikelihood_rolling task over ``documents`` (JSON lines beside its YAML); the directory for
    lm-eval's ``include_path``."""
    directory.mkdir(parents=True, exist_ok=True)
    data = directory / f"{task}.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents), encoding="utf-8")
    metrics = "".join(f"  - metric: {m}\n" for m in METRICS)
    (directory / f"{task}.yaml").write_text(
        f"task: {task}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {json.dumps(str(data))}\n"
        "test_split: test\n"
        "output_type: loglikelihood_rolling\n"
        'doc_to_text: ""\n'
        "doc_to_target: text\n"
        f"metric_list:\n{metrics}"
        "metadata:\n  version: 1.0\n",
        encoding="utf-8",
    )
    return directory


def lm_eval_scores(completions_url: str, model: str, tokenizer_dir: Path, task_dir: Path, max_length: int) -> dict:
    """lm-eval's metrics for the task in ``task_dir`` against the completions endpoint at
    ``completions_url`` (its ``local-completions`` model; the HF tokenizer in ``tokenizer_dir``)."""
    with offline_hub():
        return _lm_eval_scores(completions_url, model, tokenizer_dir, task_dir, max_length)


@contextmanager
def offline_hub() -> Iterator[None]:
    """HF_HUB_OFFLINE and HF_DATASETS_OFFLINE set for the evaluation only (lm-eval would look the task's
    data up on the Hub), then as they were: other code of this process (`pull`) needs the Hub."""
    names = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")
    before = {name: os.environ.get(name) for name in names}
    os.environ.update({name: "1" for name in names})
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _lm_eval_scores(completions_url: str, model: str, tokenizer_dir: Path, task_dir: Path, max_length: int) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    model_args = {
        "model": model,
        "base_url": completions_url,
        "tokenizer": str(tokenizer_dir),
        "tokenizer_backend": "huggingface",
        "max_length": max_length,
        "num_concurrent": 1,
        "max_retries": 1,
    }
    results = simple_evaluate(
        model="local-completions",
        model_args=model_args,
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),  # indexing its own: minutes
        bootstrap_iters=0,
        log_samples=False,
    )
    assert results is not None  # None only on non-zero ranks of a distributed run
    found = results["results"][TASK]
    return {metric: found[f"{metric},none"] for metric in METRICS}


@torch.no_grad()
def engine_scores(loaded: LoadedModel, tokenizer: Tokenizer, documents: Sequence[str], bos: int) -> Scores:
    """The documents scored as lm-eval scores them (``[bos] + ids``, each token given those before it),
    one fresh-cache forward each, from the engine's float32 logits."""
    loglikelihood, tokens = 0.0, 0
    for document in documents:
        ids = [bos, *tokenizer.encode(document, add_special_tokens=False).ids]
        inputs = torch.tensor([ids[:-1]], dtype=torch.long, device=loaded.model.device)
        logits = loaded.model(inputs, 0, loaded.model.new_cache(), loaded.experts)[0]  # [len - 1, vocab]
        targets = torch.tensor(ids[1:], dtype=torch.long, device=logits.device)
        loglikelihood += logits.log_softmax(-1).gather(1, targets[:, None]).sum().item()
        tokens += len(ids) - 1
    words = sum(len(re.split(r"\s+", d)) for d in documents)
    return Scores(loglikelihood, words, sum(len(d.encode("utf-8")) for d in documents), tokens)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve_command(path: Path, model: str, kv_dir: Path, extra: Sequence[str] = ()) -> Iterator[str]:
    """`colibri-stream serve PATH` in a child process; yields its base URL once /v1/models answers and
    stops it with SIGINT (as Ctrl-C does) at the end."""
    port = free_port()
    command = [sys.executable, "-m", "colibri_stream", "serve", str(path), "--port", str(port)]
    command += ["--kv-dir", str(kv_dir), "--model-name", model, *extra]
    child = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_until_serving(child, base)
        yield base
    finally:
        if child.poll() is None:
            child.send_signal(signal.SIGINT)
            try:
                child.wait(timeout=60)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


def _wait_until_serving(child: subprocess.Popen[str], base: str) -> None:
    deadline = time.monotonic() + START_WAIT_S
    while time.monotonic() < deadline:
        if child.poll() is not None:
            raise RuntimeError(f"serve exited with {child.returncode}: {child.stderr.read() if child.stderr else ''}")
        try:
            with urllib.request.urlopen(f"{base}/v1/models", timeout=5) as answer:
                if answer.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"serve did not answer within {START_WAIT_S:g} s")


def results_table(rows: Sequence[tuple[str, dict[str, Any], Scores, float]]) -> str:
    """Markdown: per container, lm-eval's word perplexity against the engine's on the same windows, and
    the project's own held-out perplexity (64 x 256-token windows, devtools/train_demo.py)."""
    lines = [
        "| container | lm-eval word ppl | engine word ppl | rel. diff | lm-eval byte ppl | engine token ppl "
        "| project held-out ppl |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, lm, own, project in rows:
        diff = lm["word_perplexity"] / own.word_perplexity - 1
        lines.append(
            f"| {label} | {lm['word_perplexity']:.4f} | {own.word_perplexity:.4f} | {diff:+.1e} "
            f"| {lm['byte_perplexity']:.5f} | {own.token_perplexity:.3f} | {project:.3f} |"
        )
    if len(rows) == 2:  # the second container against the first, by each measure
        (_, lm0, own0, project0), (label, lm1, own1, project1) = rows
        changes = (
            lm1["word_perplexity"] / lm0["word_perplexity"],
            own1.token_perplexity / own0.token_perplexity,
            project1 / project0,
        )
        lm_word, own_token, held_out = (f"{100 * (c - 1):+.2f}%" for c in changes)
        lines.append(
            f"\n{label} vs {rows[0][0]}: lm-eval word ppl {lm_word}, engine token ppl {own_token}, "
            f"project held-out ppl {held_out}"
        )
    return "\n".join(lines)

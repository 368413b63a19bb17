"""`serve --request-log FILE` (serve/request_log.py): one JSON line per request once its answer has ended,
with the tokens the API's usage reports, for streamed answers and refusals too; nothing without it."""

from __future__ import annotations

import json
import time
from pathlib import Path

import openai
import pytest

from colibri_stream.errors import ColibriError
from colibri_stream.runtime.turn import RuntimeOptions, load_runtime
from colibri_stream.serve.request_log import RequestLog

MODEL = "tiny"
PROMPT = "def add(a, b):\n    return a + b\n\n\n" * 12  # a few 64-token prefix blocks


@pytest.fixture(scope="module")
def logged(tiny_checkpoints, tmp_path_factory, live_server):
    options = RuntimeOptions(kv_dir=tmp_path_factory.mktemp("request-log-kv"), model_id=MODEL)
    log = tmp_path_factory.mktemp("request-log") / "requests.jsonl"
    return live_server(load_runtime(tiny_checkpoints["deepseek_v3"], options), request_log=RequestLog(log)), log


def lines(path: Path, count: int) -> list[dict]:
    """The log's lines once it has ``count`` (a line is written just after its answer's last byte went out)."""
    deadline = time.monotonic() + 30
    while len(found := path.read_text().splitlines()) < count and time.monotonic() < deadline:
        time.sleep(0.02)
    return [json.loads(line) for line in found]


def test_each_request_is_a_line_with_the_usage_the_api_reported(logged):
    served, log = logged
    client = openai.OpenAI(base_url=served.base + "/v1", api_key="unused", max_retries=0, timeout=120)
    first = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, stream=True))
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=-1)

    plain, streamed, bad = lines(log, 3)
    assert plain["route"] == streamed["route"] == bad["route"] == "/v1/completions"
    assert (plain["status"], streamed["status"], bad["status"]) == (200, 200, 400)
    assert plain["prompt_tokens"] == first.usage.prompt_tokens
    assert plain["completion_tokens"] == first.usage.completion_tokens == 4
    assert plain["cached_tokens"] == first.usage.prompt_tokens_details.cached_tokens
    usage = chunks[-1].usage
    assert streamed["prompt_tokens"] == usage.prompt_tokens and streamed["cached_tokens"] > 0  # the prefix cache
    assert streamed["cached_tokens"] == usage.prompt_tokens_details.cached_tokens
    assert 0 < streamed["ttft_s"] <= streamed["wall_s"]
    assert plain["error"] is None and "max_tokens" in bad["error"] and bad["prompt_tokens"] is None


def test_an_unwritable_log_is_a_clear_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ColibriError, match="--request-log"):
        RequestLog(tmp_path / "file" / "requests.jsonl")

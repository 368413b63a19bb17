"""--context N on run, chat and serve (plan's is tests/test_colibri_stream/planning/test_plan_config.py):
a turn may fill N positions, prompt and answer; a longer prompt is refused in one line, an answer is cut to
the room N leaves, and an N beyond the model's max_position_embeddings (512 for the tiny fixtures) is refused."""

from __future__ import annotations

import json

import pytest

from colibri_stream.cli import build_parser, main
from colibri_stream.errors import BudgetError, RequestError
from colibri_stream.planning.budget import StoreOptions
from colibri_stream.runtime.turn import RuntimeOptions, TurnOptions, load_runtime, run_turn
from colibri_stream.serve.app import Server
from colibri_stream.serve.schemas import ApiError, CompletionRequest

FAMILY = "deepseek_v3"
CONTEXT = 20


@pytest.fixture(scope="module")
def short_runtime(tiny_checkpoints):
    runtime = load_runtime(tiny_checkpoints[FAMILY], RuntimeOptions(text=False, store=StoreOptions(context=CONTEXT)))
    yield runtime
    runtime.close()


def _ids(n: int) -> list[int]:
    return [2 + i % 50 for i in range(n)]


@pytest.mark.parametrize("command", ["plan", "run", "chat", "serve"])
def test_every_command_that_sizes_a_run_takes_context(command):
    extra = ["--ids", "1"] if command == "run" else []
    assert build_parser().parse_args([command, "MODEL", "--context", "4096", *extra]).context == 4096
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "MODEL", "--context", "0", *extra])


def test_a_turn_fills_at_most_the_context(short_runtime):
    assert short_runtime.context_size == CONTEXT and short_runtime.context_source == "--context"
    with pytest.raises(RequestError, match=r"the prompt has 20 tokens; the context is 20 tokens \(--context\)"):
        run_turn(short_runtime, _ids(CONTEXT), TurnOptions(max_new_tokens=1))
    result = run_turn(short_runtime, _ids(15), TurnOptions(max_new_tokens=100))
    assert len(result.ids) == 5 and result.finish_reason == "length"


def test_without_context_the_model_decides(tiny_checkpoints):
    runtime = load_runtime(tiny_checkpoints[FAMILY], RuntimeOptions(text=False))
    try:
        assert runtime.context_size == 512 and runtime.context_source == "max_position_embeddings"
    finally:
        runtime.close()


def test_run_refuses_a_longer_prompt_in_one_line_and_cuts_answers(tiny_checkpoints, capsys):
    path = str(tiny_checkpoints[FAMILY])
    assert main(["run", path, "--ids", ",".join(map(str, _ids(30))), "--context", str(CONTEXT)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "the prompt has 30 tokens; the context is 20 tokens" in err
    argv = ["run", path, "--ids", ",".join(map(str, _ids(15))), "--context", str(CONTEXT), "--max-new-tokens", "100"]
    assert main([*argv, "--json"]) == 0
    out, err = capsys.readouterr()
    assert len(json.loads(out.strip().splitlines()[-1])["ids"]) == 5
    assert "--max-new-tokens 100 cut to 5" in err and "the context is 20" in err


def test_a_context_beyond_the_model_is_refused_in_one_line(tiny_checkpoints, capsys):
    assert main(["run", str(tiny_checkpoints[FAMILY]), "--ids", "2,3", "--context", "513"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "--context 513 is longer than this model's context: max_position_embeddings is 512" in err
    with pytest.raises(BudgetError, match="max_position_embeddings is 512"):
        load_runtime(tiny_checkpoints[FAMILY], RuntimeOptions(text=False, store=StoreOptions(context=513)))


def test_the_server_holds_requests_to_the_context(short_runtime):
    server = Server(short_runtime, slots=1)
    with pytest.raises(ApiError) as refused:
        server.token_limit(CompletionRequest(model="m", prompt=_ids(CONTEXT)), _ids(CONTEXT))
    assert refused.value.status == 400 and "context is 20 tokens" in refused.value.message
    assert server.token_limit(CompletionRequest(model="m", prompt=_ids(15)), _ids(15)) == 5
    assert server.prompt_limit == CONTEXT - 1

"""Numbers at the edges: sampling parameters that once made NaN probabilities, request fields that are
not finite, flags that crashed with a traceback, and answers that ran past the model's context."""

from __future__ import annotations

import json
import math

import pytest
import torch

from colibri_stream.cli import build_parser, main
from colibri_stream.errors import BudgetError, RequestError
from colibri_stream.planning.budget import parse_size
from colibri_stream.runtime.generate import SamplingParams, sample
from colibri_stream.runtime.turn import RuntimeOptions, TurnOptions, fit_to_context, load_runtime, run_turn
from colibri_stream.serve.intake import parse_request
from colibri_stream.serve.schemas import COMPLETION_UNIMPLEMENTED, ApiError, ChatRequest, CompletionRequest

FAMILY = "deepseek_v3"


# ------------------------------------------------------------------------------------ sampling
@pytest.mark.parametrize("temperature", [1e-300, 1e-30, 1e-38, 1e-45, 5e-324, 1e-8])
@pytest.mark.parametrize("top_p", [1.0, 0.5, 1e-300])
def test_tiny_temperatures_sample_the_best_token(temperature, top_p):
    logits = torch.randn(512, generator=torch.Generator().manual_seed(3)) * 40
    picks = {sample(logits, SamplingParams(temperature, top_p), torch.Generator().manual_seed(s)) for s in range(5)}
    assert picks == {int(logits.argmax())}


def test_a_tiny_top_p_keeps_the_best_token_at_any_temperature():
    logits = torch.randn(512, generator=torch.Generator().manual_seed(4))
    assert sample(logits, SamplingParams(1.0, 1e-300), None) == int(logits.argmax())


@pytest.mark.parametrize(
    "kwargs", [{"temperature": math.nan}, {"temperature": math.inf}, {"top_p": math.nan}, {"top_p": -math.inf}]
)
def test_non_finite_sampling_parameters_are_refused(kwargs):
    with pytest.raises(RequestError):
        SamplingParams(**kwargs)


# ------------------------------------------------------------------------------------ request bodies
def _body(**fields) -> bytes:
    return json.dumps({"model": "m", "prompt": "x", **fields}).encode()


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "m", "prompt": "x", "temperature": NaN}',
        b'{"model": "m", "prompt": "x", "top_p": Infinity}',
        b'{"model": "m", "prompt": "x", "temperature": -Infinity}',
        b'{"model": "m", "prompt": "x", "temperature": 1e400}',  # json reads it as inf
        b'{"model": "m", "prompt": "x", "top_p": 1e400}',
    ],
)
def test_non_finite_request_numbers_are_400s(raw):
    with pytest.raises(ApiError) as refused:
        parse_request(raw, CompletionRequest)
    assert refused.value.status == 400


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "m", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
        b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
        b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": "\\ud83d"}',
        b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "user": "\\udc00"}',
    ],
)
def test_lone_surrogates_are_400s(raw):
    with pytest.raises(ApiError) as refused:
        parse_request(raw, ChatRequest)
    assert refused.value.status == 400 and refused.value.code == "invalid_text"


CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
COMPLETION = {"model": "m", "prompt": "x"}
ASKING = {  # a value per unimplemented field that asks for something (type-matched: true is not 1)
    "presence_penalty": 0.5,
    "frequency_penalty": -1,
    "logit_bias": {"50256": -100},
    "top_k": 40,
    "min_p": 0.1,
    "repetition_penalty": 1.2,
}
CHAT_ASKING = {
    **ASKING,
    "functions": [{"name": "f"}],
    "function_call": {"name": "f"},
    "parallel_tool_calls": False,
    "modalities": ["text", "audio"],
    "audio": {"voice": "alloy"},
    "prediction": {"type": "content", "content": "x"},
}
COMPLETION_ASKING = {**ASKING, "top_logprobs": 5, "best_of": 2, "suffix": "tail"}  # logprobs, echo: implemented
NO_OPS = {"logprobs": False, "top_logprobs": 0, "presence_penalty": 0.0, "frequency_penalty": 0, "logit_bias": {}}


@pytest.mark.parametrize(
    ("schema", "base", "field", "value"),
    [(ChatRequest, CHAT, f, v) for f, v in CHAT_ASKING.items()]
    + [(CompletionRequest, COMPLETION, f, v) for f, v in COMPLETION_ASKING.items()],
)
def test_unimplemented_fields_that_ask_for_something_are_400s_naming_them(schema, base, field, value):
    with pytest.raises(ApiError) as refused:
        parse_request(json.dumps({**base, field: value}).encode(), schema, schema.unimplemented)
    assert refused.value.status == 400 and refused.value.param == field
    assert refused.value.message.startswith(f"{field}: not supported")


@pytest.mark.parametrize(("schema", "base"), [(ChatRequest, CHAT), (CompletionRequest, COMPLETION)])
def test_unimplemented_fields_that_ask_for_nothing_are_accepted(schema, base):
    extra = {**NO_OPS, "n": 1, "top_k": -1, "echo": False, "best_of": 1, "suffix": None, "response_format": None}
    if schema is ChatRequest:
        extra |= {"response_format": {"type": "text"}, "parallel_tool_calls": True, "function_call": "auto"}
    parse_request(json.dumps({**base, **extra}).encode(), schema, schema.unimplemented)
    with pytest.raises(ApiError, match="best_of"):  # best_of true is not best_of 1
        parse_request(json.dumps({**base, "best_of": True}).encode(), CompletionRequest, COMPLETION_UNIMPLEMENTED)


def test_tiny_but_finite_numbers_are_accepted():
    body = parse_request(_body(temperature=1e-300, top_p=5e-324), CompletionRequest)
    assert body.temperature == 1e-300 and body.top_p == 5e-324
    paired = parse_request(b'{"model": "m", "prompt": "\\ud83d\\ude00"}', CompletionRequest)
    assert paired.prompt == "\U0001f600"  # a surrogate *pair* is one valid character


# ------------------------------------------------------------------------------------ flags
@pytest.mark.parametrize(
    "flag, value",
    [
        ("--temperature", "nan"),
        ("--temperature", "inf"),
        ("--top-p", "nan"),
        ("--ram", "inf%"),
        ("--ram", "nan%"),
        ("--ram", "1e999%"),
        ("--vram", "-5%"),
        ("--ram", "9" * 400 + "GB"),
    ],
)
def test_bad_numeric_flags_are_one_line_usage_errors(flag, value, capsys):
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["run", "MODEL", "--ids", "1", flag, value])
    assert exited.value.code == 2
    assert f"argument {flag}:" in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("flag, value", [("--temperature", "-1"), ("--top-p", "0"), ("--top-p", "1.5")])
def test_out_of_range_sampling_flags_are_one_line_errors(flag, value, capsys):
    assert main(["run", "no-such-model", "--ids", "1", flag, value]) == 1  # refused before the load
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_tiny_temperature_flag_is_accepted():
    args = build_parser().parse_args(["run", "MODEL", "--ids", "1", "--temperature", "1e-300", "--ram", "25%"])
    assert args.temperature == 1e-300 and args.ram == "25%"


@pytest.mark.parametrize("value", ["inf%", "nan%", "-1%", "1e999%", "9" * 400 + "B"])
def test_parse_size_refuses_non_finite_sizes(value):
    with pytest.raises(BudgetError, match="memory.ram"):
        parse_size(value, 10**9, "memory.ram")


# ------------------------------------------------------------------------------------ the context
@pytest.fixture(scope="module")
def ids_runtime(tiny_checkpoints):
    runtime = load_runtime(tiny_checkpoints[FAMILY], RuntimeOptions(text=False))
    yield runtime
    runtime.close()


def test_a_prompt_that_fills_the_context_is_refused(ids_runtime):
    context = ids_runtime.context_size
    with pytest.raises(RequestError, match=f"{context} tokens"):
        run_turn(ids_runtime, [2] * context, TurnOptions(max_new_tokens=1))


def test_answers_are_cut_to_the_room_the_context_leaves(ids_runtime):
    context = ids_runtime.context_size
    assert fit_to_context(ids_runtime, context - 5, 100) == 5 and fit_to_context(ids_runtime, 3, 100) == 100


def test_run_says_when_it_cuts_the_answer_at_the_context(tiny_checkpoints, capsys):
    """End to end: 508 + 100 > 512, so 4 tokens and a note (run_turn cuts what reaches generate)."""
    ids = ",".join(str(2 + i % 50) for i in range(508))  # the fixture's context is 512
    assert main(["run", str(tiny_checkpoints[FAMILY]), "--ids", ids, "--max-new-tokens", "100", "--json"]) == 0
    out, err = capsys.readouterr()
    assert len(json.loads(out.strip().splitlines()[-1])["ids"]) == 4
    assert "--max-new-tokens 100 cut to 4" in err and "512" in err

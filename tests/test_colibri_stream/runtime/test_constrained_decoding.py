"""Constrained decoding (runtime/constraint.py, text/grammar.py) on the demo model, in-process: over 200
random JSON schemas of the kinds clients send (devtools/json_schemas.py: nested objects, arrays, enums,
required fields, optional values, bounded), every answer, greedy or sampled, parses and validates and
ends on a stop id; rows without a constraint keep their tokens, and a batch mixing constrained and free
rows (with MTP drafting forced on for the free ones) gives each row its solo tokens."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from colibri_stream.checkpoint.demo_model import demo_model_dir
from colibri_stream.devtools.json_schemas import random_schema
from colibri_stream.runtime.batching import ContinuousBatch, Generation, GenerationRequest
from colibri_stream.runtime.mtp_governor import MTPOptions
from colibri_stream.runtime.sampling import SamplingParams
from colibri_stream.runtime.turn import Runtime, RuntimeOptions, load_runtime
from colibri_stream.text.grammar import GrammarError, json_constraint

SCHEMAS = 200
BUDGET = 256  # tokens: the bounded schemas end far sooner (the demo's answers stay under 100)
ROWS = 50  # generations decoded together per batch


@pytest.fixture(scope="module")
def runtime(tmp_path_factory) -> Runtime:
    return load_runtime(demo_model_dir(), RuntimeOptions(kv_dir=tmp_path_factory.mktemp("kv")))


@pytest.fixture(scope="module")
def drafting(tmp_path_factory) -> Runtime:
    """The demo with MTP drafting forced on: every free row is drafted for at every step."""
    options = RuntimeOptions(kv_dir=tmp_path_factory.mktemp("kv-mtp"), mtp=MTPOptions("on", 2))
    return load_runtime(demo_model_dir(), options)


def prompt(runtime: Runtime, text: str = "Answer with a JSON object.") -> list[int]:
    return runtime.encode_chat([{"role": "user", "content": text}])


def constrained(
    runtime: Runtime, schema, sampling: SamplingParams | None = None, text="Answer with a JSON object."
) -> GenerationRequest:
    tokenizer = runtime.text_side()[0]
    constraint = json_constraint(tokenizer, runtime.vocab_size, runtime.stop_ids, schema)
    sampling = sampling or SamplingParams()
    return GenerationRequest(prompt(runtime, text), BUDGET, sampling, runtime.stop_ids, constraint=constraint)


def run(runtime: Runtime, requests: list[GenerationRequest]) -> list[Generation]:
    batch = ContinuousBatch(runtime.loaded.model, runtime.loaded.experts, speculation=runtime.speculation)
    generations = [batch.add(request) for request in requests]
    while batch:
        batch.step()
    assert all(g.error is None for g in generations)
    return generations


def answer(runtime: Runtime, generation: Generation) -> str:
    ids = generation.result.ids
    assert generation.result.stopped_on in runtime.stop_ids, "the answer must end on a stop id, not max_tokens"
    return runtime.text_side()[0].decode(ids[:-1])


def test_every_answer_to_200_random_schemas_parses_and_validates(runtime):
    rng = random.Random(69)
    schemas = [random_schema(rng) for _ in range(SCHEMAS)]
    # every fourth row samples (temperature 0.9, its own seed): the mask must hold off the argmax too
    samplings = [SamplingParams(0.9, 1.0, seed=i) if i % 4 == 3 else SamplingParams() for i in range(SCHEMAS)]
    generations = []
    for start in range(0, SCHEMAS, ROWS):
        part = zip(schemas[start : start + ROWS], samplings[start : start + ROWS], strict=True)
        generations += run(runtime, [constrained(runtime, schema, sampling) for schema, sampling in part])
    kinds = {json.dumps(s, sort_keys=True) for s in schemas}
    assert len(kinds) == SCHEMAS  # 200 different schemas
    for schema, generation in zip(schemas, generations, strict=True):
        jsonschema.validate(json.loads(answer(runtime, generation)), schema)


def test_the_features_clients_send_are_enforced(runtime):
    """One schema with each feature at once; the answer holds every required key, the enum, the bounds."""
    schema = {
        "type": "object",
        "properties": {
            "mode": {"type": "string", "enum": ["fast", "slow"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 2, "maxItems": 2},
            "limits": {
                "type": "object",
                "properties": {"low": {"type": "integer", "minimum": 3, "maximum": 9}, "on": {"type": "boolean"}},
                "required": ["low", "on"],
                "additionalProperties": False,
            },
            "note": {"anyOf": [{"type": "string", "maxLength": 4}, {"type": "null"}]},
        },
        "required": ["mode", "tags", "limits", "note"],
        "additionalProperties": False,
    }
    (generation,) = run(runtime, [constrained(runtime, schema)])
    value = json.loads(answer(runtime, generation))
    jsonschema.validate(value, schema)
    assert list(value) == ["mode", "tags", "limits", "note"] and len(value["tags"]) == 2


def test_a_mixed_batch_gives_each_row_its_solo_tokens(drafting):
    """Free rows (greedy, sampled) drafted for by MTP, and constrained rows (never drafted for), together:
    each row's tokens are its solo run's; the free rows' are those of a batch with no constraint at all."""
    rng = random.Random(7)
    schemas = [random_schema(rng) for _ in range(3)]
    free = [
        GenerationRequest(prompt(drafting, "Write a haiku about disks."), 24),
        GenerationRequest(prompt(drafting, "def main():"), 24, SamplingParams(0.8, 0.9, seed=3)),
    ]

    def requests() -> list[GenerationRequest]:  # fresh constraints: each run follows its own
        bound = [
            constrained(drafting, s, SamplingParams(0.7, 1.0, seed=1) if i else SamplingParams())
            for i, s in enumerate(schemas)
        ]
        return [free[0], bound[0], free[1], bound[1], bound[2]]

    mixed = [g.result.ids for g in run(drafting, requests())]
    alone = [run(drafting, [request])[0].result.ids for request in requests()]
    assert mixed == alone
    assert [g.result.ids for g in run(drafting, free)] == [mixed[0], mixed[2]]
    assert all(len(ids) == 24 for ids in (mixed[0], mixed[2]))  # the free rows ran (no stop id asked)
    assert drafting.speculation is not None and drafting.speculation.governor.drafted > 0  # drafts were verified


def test_a_constrained_row_is_never_drafted_for(drafting):
    (generation,) = run(drafting, [constrained(drafting, random_schema(random.Random(3)))])
    assert generation.result.stats.drafted == 0 and generation.result.stats.decode_tokens > 5


def test_a_schema_the_library_cannot_enforce_is_refused_naming_why(runtime):
    tokenizer = runtime.text_side()[0]
    for schema, why in [
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"type": "strin"}, "strin"),
        ({"$ref": "#/$defs/Nope"}, "Nope"),
        ({"type": "array", "minItems": 3, "maxItems": 1}, "minItems"),
    ]:
        with pytest.raises(GrammarError, match=why):
            json_constraint(tokenizer, runtime.vocab_size, runtime.stop_ids, schema)

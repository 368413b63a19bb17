"""ContinuousBatch: generations that join at different steps, sample differently, stop, get cancelled
or read a long prompt in chunks each produce exactly their solo run's tokens, and a long prompt costs
the decoding ones one chunk per step, never a stall."""

from __future__ import annotations

import pytest

from colibri_stream.errors import RequestError
from colibri_stream.planning.budget import StoreOptions
from colibri_stream.runtime.batching import ContinuousBatch, GenerationRequest
from colibri_stream.runtime.generate import SamplingParams, generate
from colibri_stream.runtime.loader import load

CHUNK = 8  # prompt positions per prefill forward: small, so a 30-token prompt takes 4 steps
LONG_PROMPT = list(range(5, 35))


def still() -> float:
    """A clock that stands still: each step makes one decode pass (no prompt chunk seems to take time), so
    the tokens per step are counts these tests can assert."""
    return 0.0


def requests(stop_id: int) -> list[tuple[int, GenerationRequest]]:
    """(join step, request): greedy, seeded sampling, top-p, a stop id, a long prompt joining late."""
    return [
        (0, GenerationRequest([1, 5, 9, 3, 7, 2, 11], 9)),
        (0, GenerationRequest([4, 4, 2], 7, SamplingParams(0.8, 1.0, seed=11))),
        (2, GenerationRequest([6, 1, 2, 3, 4, 5, 6, 12], 8, SamplingParams(1.3, 0.7, seed=5))),
        (3, GenerationRequest(LONG_PROMPT, 5)),
        (4, GenerationRequest([9, 9, 9], 12, stop_ids=[stop_id])),
    ]


def solo(model, experts, request: GenerationRequest) -> list[int]:
    return generate(
        model,
        request.prompt_ids,
        request.max_new_tokens,
        experts,
        request.sampling,
        request.stop_ids,
        prefill_chunk=CHUNK,
    ).ids


def run_batched(model, experts, joined: list[tuple[int, GenerationRequest]]):
    """Step the batch (its clock still), adding each request at its step; per step, how many tokens each one has."""
    batch, generations, progress, step = ContinuousBatch(model, experts, CHUNK, clock=still), {}, [], 0
    while step == 0 or batch or len(generations) < len(joined):
        for i, (at, request) in enumerate(joined):
            if at == step:
                generations[i] = batch.add(request)
        batch.step()
        progress.append({i: len(g.result.ids) for i, g in generations.items()})
        step += 1
    return [generations[i] for i in range(len(joined))], progress


def stop_token_of(model, experts) -> int:
    """A token the stop-id request really samples (its 3rd), so that request stops early."""
    return generate(model, [9, 9, 9], 3, experts).ids[2]


def check(model, experts) -> None:
    joined = requests(stop_token_of(model, experts))
    generations, progress = run_batched(model, experts, joined)
    for generation, (_, request) in zip(generations, joined, strict=True):
        assert generation.error is None
        assert generation.result.ids == solo(model, experts, request)
    assert generations[4].result.stopped_on is not None and len(generations[4].result.ids) == 3
    # The long prompt (joined at step 3) reads 4 chunks over steps 3-6; meanwhile request 0 decodes
    # one token every step.
    long_prompt_steps = range(3, 3 + -(-len(LONG_PROMPT) // CHUNK))
    for step in long_prompt_steps:
        assert progress[step].get(3, 0) == (1 if step == long_prompt_steps[-1] else 0)
        assert progress[step][0] == progress[step - 1][0] + 1


def test_joined_generations_equal_their_solo_runs(loaded):
    check(loaded.model, loaded.experts)


def test_joined_generations_equal_their_solo_runs_under_a_tight_budget(stream_container):
    loaded = load(stream_container, "float32", StoreOptions(ram="25%"))
    try:
        before = loaded.experts.snapshot()
        check(loaded.model, loaded.experts)
        assert loaded.experts.snapshot().minus(before).misses > 0
    finally:
        loaded.experts.close()


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints):
    from colibri_stream.runtime.loader import load_checkpoint

    return load_checkpoint(tiny_checkpoints["deepseek_v32"])


def test_a_cancelled_generation_leaves_the_step_it_is_cancelled(tiny):
    batch = ContinuousBatch(tiny.model, tiny.experts, CHUNK, clock=still)
    cancel = {"decoding": False, "reading": False}
    decoding = batch.add(GenerationRequest([1, 2, 3], 50, should_stop=lambda: cancel["decoding"]))
    staying = batch.add(GenerationRequest([3, 2, 1], 50))
    reading = batch.add(GenerationRequest(LONG_PROMPT, 50, should_stop=lambda: cancel["reading"]))
    batch.step()
    batch.step()
    cancel["decoding"] = cancel["reading"] = True
    finished = batch.step()
    assert set(finished) == {decoding, reading} and len(batch) == 1
    assert decoding.result.cancelled and reading.result.cancelled and reading.result.ids == []
    assert not staying.done


def test_a_request_that_cannot_run_is_refused_when_added(tiny):
    batch = ContinuousBatch(tiny.model, tiny.experts)
    with pytest.raises(RequestError):
        batch.add(GenerationRequest([], 4))
    cache = tiny.model.new_cache()
    generate(tiny.model, [1, 2, 3], 1, tiny.experts, cache=cache)
    with pytest.raises(ValueError, match="must extend it"):
        batch.add(GenerationRequest([1, 2, 3], 4, cache=cache))
    assert batch.add(GenerationRequest([1], 0)).done and len(batch) == 0


def test_a_failing_forward_ends_only_its_generations(tiny, monkeypatch):
    batch = ContinuousBatch(tiny.model, tiny.experts, CHUNK, clock=still)
    first = batch.add(GenerationRequest([1, 2, 3], 3))
    batch.step()  # first: prompt read, one token
    broken = batch.add(GenerationRequest(LONG_PROMPT, 3))

    def failing_prefill(self, tokens, *args, **kwargs):
        raise RuntimeError("disk gone")

    monkeypatch.setattr(type(tiny.model), "forward_prompt", failing_prefill)  # prompts only: decode goes on
    finished = batch.step()
    assert finished == [broken] and isinstance(broken.error, RuntimeError)
    while batch:
        batch.step()
    assert first.error is None and len(first.result.ids) == 3


def test_short_prompts_share_a_step_and_a_long_one_waits_its_turn(tiny):
    """Prompt chunks fill one chunk's worth of positions per step, oldest first: two prompts of 3
    positions (CHUNK 8) are read together; a third whose chunk (8) no longer fits waits for the next step."""
    batch = ContinuousBatch(tiny.model, tiny.experts, CHUNK, clock=still)
    short = [batch.add(GenerationRequest([i + 1, i + 2, i + 3], 4)) for i in range(2)]
    later = batch.add(GenerationRequest(LONG_PROMPT, 4))
    batch.step()
    assert [len(g.result.ids) for g in short] == [1, 1] and later.result.ids == [] and len(later.pending) == 30
    batch.step()  # the long prompt's first chunk has the step to itself; the short ones decode
    assert [len(g.result.ids) for g in short] == [2, 2] and len(later.pending) == 30 - CHUNK
    while batch:
        batch.step()
    for generation in [*short, later]:
        assert generation.result.ids == solo(tiny.model, tiny.experts, generation.request)


def test_a_prompt_beside_one_that_asks_for_its_logprobs_is_read_in_the_same_step(tiny):
    """Prompts asking for their logprobs are read on their own (every position's logits); the one prompt left
    beside such a reader has no partner to share a forward with, and is still read that step."""
    batch = ContinuousBatch(tiny.model, tiny.experts, CHUNK, clock=still)
    logprobs = batch.add(GenerationRequest([1, 2, 3], 2, prompt_logprobs=1))
    plain = batch.add(GenerationRequest([4, 5, 6], 2))
    batch.step()
    assert logprobs.pending == [] and plain.pending == []
    assert len(logprobs.result.ids) == len(plain.result.ids) == 1
    while batch:
        batch.step()
    assert plain.result.ids == solo(tiny.model, tiny.experts, plain.request)


class ForwardClock:
    """A clock that only the model's forwards move, each by a set cost: the share of a step the decoding
    rows get is then a count, not a timing."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def costing(self, forward, seconds: float):
        def timed(*args, **kwargs):
            self.now += seconds
            return forward(*args, **kwargs)

        return timed


def test_rows_decoding_beside_a_long_prompt_get_a_share_of_its_time(tiny, monkeypatch):
    clock = ForwardClock()
    for name, cost in (("forward_prompt", 1.0), ("forward_prompts", 1.0), ("forward_rows", 0.25)):
        monkeypatch.setattr(tiny.model, name, clock.costing(getattr(tiny.model, name), cost))
    batch = ContinuousBatch(tiny.model, tiny.experts, CHUNK, clock=clock)
    decoding = batch.add(GenerationRequest([1, 2, 3], 30))
    batch.step()  # its prompt: the first token, then decode passes for as long as the prompt took
    after_prompt = len(decoding.result.ids)
    reading = batch.add(GenerationRequest(LONG_PROMPT, 1))
    per_step = []
    while not reading.done:
        before = len(decoding.result.ids)
        batch.step()
        per_step.append(len(decoding.result.ids) - before)
    # each 1.0 s chunk of the long prompt is followed by 1.0 s of 0.25 s decode passes (DECODE_SHARE 1.0)
    assert per_step == [4] * -(-len(LONG_PROMPT) // CHUNK)
    assert after_prompt == 1
    while batch:
        batch.step()
    assert decoding.result.ids == solo(tiny.model, tiny.experts, GenerationRequest([1, 2, 3], 30))

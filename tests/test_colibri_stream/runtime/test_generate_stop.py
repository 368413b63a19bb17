"""generate()'s should_stop hook: a cancelled generation is a prefix of the full one and leaves the
cache consistent, so a session can store it and continue."""

from __future__ import annotations

from colibri_stream.devtools import fixtures
from colibri_stream.runtime.generate import generate
from colibri_stream.runtime.loader import load_checkpoint


def test_should_stop_cuts_after_the_current_token(tiny_checkpoints):
    loaded = load_checkpoint(tiny_checkpoints["deepseek_v32"])
    prompt = fixtures.make_prompt(512, 12)
    full = generate(loaded.model, prompt, 10, loaded.experts).ids
    seen: list[int] = []
    cache = loaded.model.new_cache()
    cut = generate(
        loaded.model, prompt, 10, loaded.experts, cache=cache, on_token=seen.append, should_stop=lambda: len(seen) >= 4
    )
    assert cut.cancelled and cut.ids == seen == full[:4]
    assert cache.length == len(prompt) + 3  # the last token was emitted but never run
    resumed = generate(loaded.model, prompt + cut.ids, 6, loaded.experts, cache=cache).ids
    assert resumed == full[4:]

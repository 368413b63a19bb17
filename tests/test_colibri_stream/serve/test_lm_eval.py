"""A client no one here wrote: lm-evaluation-harness's local-completions model scores the served demo
model on a local loglikelihood_rolling task, and the word perplexity it reports is the one the
engine's own logits give the same text (tools/lm_eval_check.py runs it on more text, float and int4)."""

from __future__ import annotations

import textwrap
from pathlib import Path

from tokenizers import Tokenizer

from colibri_stream.checkpoint.demo_model import demo_model_dir
from colibri_stream.devtools.lm_eval_check import engine_scores, lm_eval_scores, text_pieces, write_task
from colibri_stream.runtime.loader import load_checkpoint
from colibri_stream.runtime.turn import RuntimeOptions, load_runtime

REL_TOL = 1e-5  # float32 logits through two paths (chunked prefill in the server, one forward here)


def test_lm_eval_word_perplexity_equals_the_engines(live_server, tmp_path):
    demo = demo_model_dir()
    runtime = load_runtime(demo, RuntimeOptions(kv_dir=tmp_path / "kv", model_id="demo"))
    served = live_server(runtime)
    # any text will do for an equality (the tool scores held-out text): a stdlib module, found at once
    documents = text_pieces([Path(textwrap.__file__).read_text()], count=2, max_chars=400)
    reported = lm_eval_scores(
        f"{served.base}/v1/completions", "demo", demo, write_task(tmp_path / "task", documents), max_length=2048
    )
    tokenizer = Tokenizer.from_file(str(demo / "tokenizer.json"))
    own = engine_scores(load_checkpoint(demo), tokenizer, documents, bos=tokenizer.token_to_id("<bos>"))
    assert own.tokens > 100 and 1 < own.token_perplexity < 1000  # the trained model, on real text
    assert abs(reported["word_perplexity"] / own.word_perplexity - 1) < REL_TOL
    assert abs(reported["byte_perplexity"] / own.byte_perplexity - 1) < REL_TOL

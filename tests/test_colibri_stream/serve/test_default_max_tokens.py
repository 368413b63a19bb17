"""A request that sets no answer length (Aider sends none) gets the server's default, a setting (budget key
``serve.default_max_tokens``, flag ``--default-max-tokens``), never the rest of the context."""

from __future__ import annotations

import openai
import pytest

from colibri_stream import cli
from colibri_stream.cli.options import runtime_options
from colibri_stream.errors import BudgetError
from colibri_stream.planning.settings import BY_NAME
from colibri_stream.runtime.turn import RuntimeOptions, load_runtime

FAMILY = "deepseek_v3"


def serve_options(*flags: str):
    return runtime_options(cli.build_parser().parse_args(["serve", "MODEL", *flags])).store


def test_the_budget_file_sets_the_default_and_the_flag_wins(tmp_path):
    budget = tmp_path / "b.toml"
    budget.write_text("[serve]\ndefault_max_tokens = 7\n")
    assert serve_options("--budget", str(budget))["default_max_tokens"] == 7
    assert serve_options("--budget", str(budget), "--default-max-tokens", "9")["default_max_tokens"] == 9
    assert serve_options()["default_max_tokens"] == BY_NAME["default_max_tokens"].default


def test_a_default_below_one_is_refused_naming_the_key(tmp_path):
    budget = tmp_path / "b.toml"
    budget.write_text("[serve]\ndefault_max_tokens = 0\n")
    with pytest.raises(BudgetError, match=r"serve\.default_max_tokens must be >= 1"):
        serve_options("--budget", str(budget))


@pytest.fixture(scope="module")
def client(tiny_checkpoints, tmp_path_factory, live_server) -> openai.OpenAI:
    options = RuntimeOptions(kv_dir=tmp_path_factory.mktemp("kv"), model_id="tiny")
    served = live_server(load_runtime(tiny_checkpoints[FAMILY], options), default_max_tokens=3)
    return openai.OpenAI(base_url=f"http://127.0.0.1:{served.port}/v1", api_key="x", max_retries=0, timeout=120)


def test_no_max_tokens_is_cut_at_the_default(client):
    answer = client.completions.create(model="tiny", prompt=[5, 6, 7, 8], temperature=0)
    assert (answer.usage.completion_tokens, answer.choices[0].finish_reason) == (3, "length")
    longer = client.completions.create(model="tiny", prompt=[5, 6, 7, 8], temperature=0, max_tokens=6)
    assert longer.usage.completion_tokens == 6  # an explicit max_tokens is not capped by the default
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    assert chat.usage.completion_tokens <= 3

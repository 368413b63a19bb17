"""`colibri-stream run` end to end, in-process and as the installed console script."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from colibri_stream import cli
from colibri_stream.devtools import fixtures


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_run_json_matches_the_oracle(tiny_checkpoints, capsys):
    path = tiny_checkpoints["deepseek_v32"]
    prompt = fixtures.make_prompt(512, 20)
    code, out, _ = _run(
        capsys,
        "run",
        str(path),
        "--ids",
        ",".join(map(str, prompt)),
        "--max-new-tokens",
        "12",
        "--temperature",
        "0",
        "--json",
    )
    assert code == 0
    result = json.loads(out.strip().splitlines()[-1])
    assert result["ids"] == fixtures.oracle_greedy(fixtures.load_reference(path), prompt, 12)
    stats = result["stats"]
    assert stats["prefill_tokens"] == 20 and stats["decode_tokens"] == 11
    assert stats["prefill_s"] > 0 and stats["decode_s"] > 0 and stats["decode_tok_per_s"] > 0


def test_run_prompt_text_uses_the_tokenizer(tiny_checkpoints, capsys):
    code, out, _ = _run(capsys, "run", str(tiny_checkpoints["glm_moe_dsa"]), "--prompt", "Hello experts", "--json")
    result = json.loads(out.strip().splitlines()[-1])
    assert code == 0 and len(result["ids"]) == 32 and isinstance(result["text"], str)


def test_console_script_runs(tiny_checkpoints):
    exe = shutil.which("colibri-stream")
    done = subprocess.run(
        [exe, "run", str(tiny_checkpoints["kimi_k2"]), "--ids", "5,6,7", "--max-new-tokens", "3", "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert len(json.loads(done.stdout.strip().splitlines()[-1])["ids"]) == 3


@pytest.mark.parametrize(
    "argv_tail, message",
    [
        (["--ids", "1,999999"], "outside the vocabulary"),
        (["--ids", "1", "--top-p", "0"], "top_p"),
    ],
)
def test_bad_input_is_one_line_error(tiny_checkpoints, capsys, argv_tail, message):
    code, _, err = _run(capsys, "run", str(tiny_checkpoints["deepseek_v3"]), *argv_tail)
    assert code == 1 and message in err and len(err.strip().splitlines()) == 1


def test_missing_tokenizer_and_missing_checkpoint_are_named(tmp_path, tiny_checkpoints, capsys):
    shutil.copytree(tiny_checkpoints["deepseek_v3"], tmp_path / "m")
    (tmp_path / "m" / "tokenizer.json").unlink()
    code, _, err = _run(capsys, "run", str(tmp_path / "m"), "--prompt", "hi")
    assert code == 1 and "tokenizer.json: not found" in err
    code, _, err = _run(capsys, "run", str(tmp_path / "nowhere"), "--ids", "1")
    assert code == 1 and "config.json: not found" in err


def test_malformed_ids_are_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["run", "x", "--ids", "1,a"])
    assert exit_info.value.code == 2 and "comma-separated integers" in capsys.readouterr().err

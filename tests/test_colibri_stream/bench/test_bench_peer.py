"""The bench's peer (transformers + accelerate disk offload): its manual greedy loop is transformers' own."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from colibri_stream.bench import peer as bench_peer
from colibri_stream.bench.stress_model import QUICK, write_stress_checkpoint

PROMPT = [5, 17, 300, 2, 999, 64]


def _reference_greedy(model_dir, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' generate() on the fully resident float32 model, with the eos stop switched off."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()


def test_offloaded_peer_matches_transformers_generate(tmp_path):
    model_dir = write_stress_checkpoint(tmp_path / "m", QUICK, progress=False)
    # QUICK is ~26 MB in float32: 12 MB keeps the embeddings and early layers resident, the rest on disk.
    result = bench_peer.run_peer(model_dir, PROMPT, 8, 12_000_000, tmp_path / "offload", dtype="float32")
    assert result["offloaded_bytes"] > 0 and result["device_map_summary"].get("disk", 0) > 0
    assert result["offload_folder_bytes"] > 0  # the fused experts of offloaded layers are re-saved at load
    assert result["decode_tokens"] == 7 and result["decode_tok_per_s"] > 0 and result["ttft_s"] > 0
    assert result["ids"] == _reference_greedy(model_dir, PROMPT, 8)


def test_cli_refuses_a_used_offload_folder_in_one_line(tmp_path, capsys):
    (tmp_path / "offload").mkdir()
    (tmp_path / "offload" / "stale.safetensors").write_bytes(b"x")
    argv = [str(tmp_path), "--ids", "1,2", "--max-new-tokens", "2", "--max-memory", "1000000"]
    assert bench_peer.main([*argv, "--offload-folder", str(tmp_path / "offload")]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "not empty" in err


@pytest.mark.parametrize("ids", ["1,x", ""])
def test_cli_rejects_bad_ids(ids, tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench_peer.main(
            [str(tmp_path), "--ids", ids, "--max-new-tokens", "2", "--max-memory", "1", "--offload-folder", "o"]
        )
    assert "--ids" in capsys.readouterr().err


def test_json_is_the_last_stdout_line(tmp_path, capsys):
    model_dir = write_stress_checkpoint(tmp_path / "m", QUICK, progress=False)
    argv = [str(model_dir), "--ids", "1,2,3", "--max-new-tokens", "2", "--max-memory", "8000000"]
    assert bench_peer.main([*argv, "--offload-folder", str(tmp_path / "o"), "--dtype", "bfloat16"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["dtype"] == "bfloat16" and len(result["ids"]) == 2 and result["read_bytes_per_token"] >= 0

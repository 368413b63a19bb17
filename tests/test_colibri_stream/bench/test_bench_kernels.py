"""`bench --kernels` reports a measured ratio (never a timing assertion)."""

from __future__ import annotations

import json

from colibri_stream import cli


def test_bench_kernels_json_reports_the_ratio(capsys):
    argv = ["bench", "--kernels", "--experts", "2", "--dim", "1024", "--inter", "512", "--json"]
    assert cli.main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["working_set_bytes"] > 0 and result["memcpy_GBps"] > 0 and result["int4_ffn_GBps"] > 0
    ratio = result["ratios"]["int4_ffn_vs_memcpy"]
    assert (
        ratio == round(result["int4_ffn_GBps"] / result["memcpy_GBps"], 3)
        or abs(ratio - result["int4_ffn_GBps"] / result["memcpy_GBps"]) < 0.05 * ratio
    )
    kinds = result["kinds"]
    assert set(kinds) == {"int4-f16-g64", "int4-bf16-g32", "mxfp4-e8m0-g32"}
    for kind in kinds.values():  # packed bytes through the FFN at 1 row (GEMV) and 4 (few rows) vs memcpy
        assert kind["working_set_bytes"] > 0 and kind["memcpy_GBps"] > 0
        assert set(kind["rows"]) == {"1", "4"} and all(
            r["ffn_GBps"] > 0 and r["vs_memcpy"] > 0 for r in kind["rows"].values()
        )
    assert kinds["mxfp4-e8m0-g32"]["working_set_bytes"] < kinds["int4-bf16-g32"]["working_set_bytes"]  # 1-byte scales

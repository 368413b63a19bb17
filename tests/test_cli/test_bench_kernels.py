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

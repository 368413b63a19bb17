"""The limit line's bytes per token of our int8 path: what a decode step reads, as the loaded model holds it."""

from __future__ import annotations

from colibri_stream.bench.suite import coded_dense_bytes_per_token
from colibri_stream.runtime.loader import load
from engine.mla.attention import MLA
from storage.container.reader import Container


def test_an_int8_wkv_b_counts_as_the_records_decode_attention_reads(make_container):
    """With int8 activations attention reads wkv_b's int8 codes and float32 scales (MLA.hold_kv_b_int8), not
    the float32 weight: counted as four bytes a weight, the line overstated our bytes (19 MB a token on the
    12-layer stress model) and so our fraction of it. The indexer's weights_proj stays float32."""
    path = make_container("glm_moe_dsa", "int4", "int8")
    container = Container(path)
    kv_b = {name for name in container.dense if name.endswith(".attn.wkv_b.weight")}
    assert kv_b and all(container.dense[name].dtype == "int8" for name in kv_b)
    without = {k: v for k, v in container.dense.items() if k not in kv_b}
    counted = coded_dense_bytes_per_token(container.dense) - coded_dense_bytes_per_token(without)

    mlas = [m for m in load(path, activations="int8").model.modules() if isinstance(m, MLA)]
    assert len(mlas) == len(kv_b) and all(m.kv_b_group > 0 for m in mlas)
    held = sum(m.kv_b_codes.nbytes + m.kv_b_scales.nbytes for m in mlas)
    assert counted == held
    assert held < sum(m.wkv_b.weight.numel() for m in mlas) * 4 / 3  # well under the float32 weight's bytes

    weights_proj = [n for n in container.dense if n.endswith("indexer.weights_proj.weight")]
    assert weights_proj
    only_proj = {n: container.dense[n] for n in weights_proj}
    assert coded_dense_bytes_per_token(only_proj) == sum(
        4 * container.dense[n].shape[0] * container.dense[n].shape[1] for n in weights_proj
    )

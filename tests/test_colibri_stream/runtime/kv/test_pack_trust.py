"""KV packs you can trust (#70): valid checksums are not enough. An import refuses values that are not
finite or beyond what the model produces (naming the file, position and layer), `--verify N` catches an
honest pack filed under another prompt's tokens, blocks record where they came from and go into the
importing tenant's namespace, and an honest import leaves greedy tokens unchanged."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from colibri_stream import cli
from colibri_stream.devtools import fixtures
from colibri_stream.runtime.kv.prefix_cache import BLOCK_TOKENS, tenant_of_key
from colibri_stream.runtime.turn import RuntimeOptions, TurnOptions, load_runtime, run_turn
from storage.kv.log import HEADER_BYTES, encode_records
from storage.kv.pack import read_pack_header, read_pack_records
from storage.kv.prefix_store import PrefixConfig

PROMPT = fixtures.make_prompt(512, 203, seed=3)  # three whole blocks: a 192-position pack
OTHER = fixtures.make_prompt(512, 203, seed=5)
FOLLOW_UP = fixtures.make_prompt(512, 21, seed=4)
# the rows of a deepseek_v3 record, float32: per layer latent (kv_lora_rank) then rope key
LATENT, ROPE = 32, 16  # tiny deepseek_v3 (fixtures); checked against the geometry below


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    status = cli.main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def _run(container: Path, kv_dir: Path, ids: list[int], prefix: PrefixConfig | None = None, tenant: str | None = None):
    runtime = load_runtime(container, RuntimeOptions(kv_dir=kv_dir, text=False, prefix=prefix or PrefixConfig()))
    try:
        return run_turn(runtime, ids, TurnOptions(max_new_tokens=6, tenant=tenant))
    finally:
        runtime.close()


@pytest.fixture(scope="module")
def packs(make_container, tmp_path_factory) -> dict[str, Path]:
    """The container and honest packs of PROMPT, of OTHER, and of a prompt sharing PROMPT's first block."""
    root = tmp_path_factory.mktemp("packs")
    container = make_container("deepseek_v3", "int4", "f32")
    made = {"container": container}
    for name, ids in (("prompt", PROMPT), ("other", OTHER), ("late", PROMPT[:BLOCK_TOKENS] + OTHER[BLOCK_TOKENS:])):
        _run(container, root / "source", ids)
        pack = root / f"{name}.kvpack"
        status = cli.main(["kv", "export", str(container), str(pack), "--ids", ",".join(map(str, ids)),
                           "--kv-dir", str(root / "source")])  # fmt: skip
        assert status == 0
        made[name] = pack
    return made


def _rewrite(pack: Path, out: Path, tokens: list[int] | None = None, edit: Callable[[np.ndarray], None] | None = None):
    """``pack`` rewritten with other tokens or payloads (float32 values [n, values], edited in place), every
    checksum valid: what a careless or hostile tool writes."""
    header = read_pack_header(pack)
    ids, payloads = (np.concatenate(x) for x in zip(*read_pack_records(pack, header, 1024), strict=True))
    payloads = payloads.copy()
    if edit is not None:
        edit(payloads.view(np.float32))
    if tokens is not None:
        ids = np.asarray(tokens[: len(ids)], dtype=np.uint32)
    records = encode_records(ids, payloads, 0, header.geometry.record_bytes)
    out.write_bytes(pack.read_bytes()[:HEADER_BYTES] + records.tobytes())
    return out


def _import(capsys, packs, pack: Path, kv_dir: Path, *flags: str) -> tuple[int, str, str]:
    return _cli(capsys, "kv", "import", str(packs["container"]), str(pack), "--kv-dir", str(kv_dir), *flags)


def test_the_fixture_geometry_is_the_one_the_edits_assume(packs):
    geometry = read_pack_header(packs["prompt"]).geometry
    assert (geometry.kv_lora_rank, geometry.qk_rope_head_dim, geometry.dtype) == (LATENT, ROPE, "float32")


def _nan(values: np.ndarray) -> None:
    values[70, (LATENT + ROPE) * 1 + 3] = np.nan  # position 70, layer 1's latent


def _huge(values: np.ndarray) -> None:
    values[5, LATENT : LATENT + ROPE] *= 1e6  # position 5, layer 0's rope key


def _random(values: np.ndarray) -> None:
    raw = values.view(np.uint8)
    raw[:] = np.random.default_rng(0).integers(0, 256, raw.shape, dtype=np.uint8)


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (_nan, "position 70: layer 1 latent holds NaN"),
        (_huge, "position 5: layer 0 rope key has norm"),
        (_random, "position 0: layer 0 latent"),
    ],
    ids=["nan", "huge", "random-bytes"],
)
def test_values_that_are_not_finite_or_beyond_the_models_are_refused_naming_file_and_layer(
    packs, tmp_path, capsys, edit, named
):
    bad = _rewrite(packs["prompt"], tmp_path / "bad.kvpack", edit=edit)
    status, _, err = _import(capsys, packs, bad, tmp_path / "kv")
    assert status == 1 and str(bad) in err and named in err, err
    assert not list((tmp_path / "kv").rglob("*.kvblock"))  # refused whole


def test_an_honest_pack_filed_under_other_tokens_is_caught_by_verify(packs, tmp_path, capsys):
    misfiled = _rewrite(packs["other"], tmp_path / "misfiled.kvpack", tokens=PROMPT)
    status, _, err = _import(capsys, packs, misfiled, tmp_path / "kv", "--verify", "4")
    assert status == 1 and str(misfiled) in err and "position 0: layer 0 latent differs" in err, err
    # the same values pass the bounds: only recomputing tells them from PROMPT's
    status, _, err = _import(capsys, packs, misfiled, tmp_path / "unchecked")
    assert status == 0, err

    # agreeing with PROMPT on its first block: the leading positions pass, drawn later ones do not
    late = _rewrite(packs["late"], tmp_path / "late.kvpack", tokens=PROMPT)
    status, _, err = _import(capsys, packs, late, tmp_path / "kv", "--verify", "16")
    assert status == 1 and "differs from what this model computes" in err, err
    assert int(err.split("position ")[1].split(":")[0]) >= BLOCK_TOKENS
    assert not list((tmp_path / "kv").rglob("*.kvblock"))


def test_an_honest_import_records_its_origin_and_leaves_greedy_tokens_unchanged(packs, tmp_path, capsys):
    status, out, err = _import(capsys, packs, packs["prompt"], tmp_path / "kv", "--verify", "8", "--json")
    assert status == 0, err
    assert json.loads(out) == {"pack": "prompt", "positions": 192, "blocks_added": 3}
    _, out, _ = _cli(capsys, "kv", "prefix", str(packs["container"]), "--kv-dir", str(tmp_path / "kv"), "--json")
    (group,) = json.loads(out)
    (origin,) = group["origins"]
    assert origin.startswith("pack 'prompt' file 'prompt.kvpack' sha256 ") and " imported " in origin

    warm = _run(packs["container"], tmp_path / "kv", PROMPT + FOLLOW_UP)
    cold = _run(packs["container"], tmp_path / "off", PROMPT + FOLLOW_UP, PrefixConfig(enabled=False))
    assert warm.stats["prompt_sources"]["prefix_disk"] == 192
    assert warm.ids == cold.ids


def test_an_import_goes_into_the_named_keys_namespace(packs, tmp_path, capsys):
    key_file = tmp_path / "key"
    key_file.write_text("sk-team\n")
    status, _, err = _import(capsys, packs, packs["prompt"], tmp_path / "kv", "--key-file", str(key_file))
    assert status == 0, err
    keyed = _run(packs["container"], tmp_path / "kv", PROMPT + FOLLOW_UP, tenant=tenant_of_key(b"sk-team"))
    assert keyed.stats["reused_tokens"] == 192
    other = _run(packs["container"], tmp_path / "kv", PROMPT + FOLLOW_UP, tenant=tenant_of_key(b"sk-other"))
    assert other.stats["reused_tokens"] == 0
    status, _, err = _import(capsys, packs, packs["prompt"], tmp_path / "kv", "--key-file", str(tmp_path / "none"))
    assert status == 1 and "--key-file" in err

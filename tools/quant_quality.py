"""The int4/int8 quality gate: per-matrix relative error by group size, and top-1 agreement / KL of
quantised vs float logits on the tiny fixtures (teacher-forced over prompt + 32 greedy tokens).

    python tools/quant_quality.py            # prints markdown tables (docs/quantization.md)
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from colibri_stream.convert.converter import Converter, ConvertOptions
from colibri_stream.convert.quality import mean_kl, relative_error, top1_agreement
from colibri_stream.devtools import fixtures
from colibri_stream.runtime.generate import generate
from colibri_stream.runtime.loader import load_checkpoint, load_container

GROUPS = (32, 64, 128)


def matrices() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    student_t = torch.distributions.StudentT(4.0)
    torch.manual_seed(0)
    return {
        "gaussian 2048x7168": torch.randn(2048, 7168, generator=gen) * 0.02,
        "student-t(4) 2048x7168 (outliers)": student_t.sample((2048, 7168)) * 0.02,
    }


def matrix_table() -> list[str]:
    rows = ["| matrix | bits | " + " | ".join(f"group {g}" for g in GROUPS) + " |", "|---|---|" + "---|" * len(GROUPS)]
    for name, w in matrices().items():
        for bits in (4, 8):
            cells = [f"{relative_error(w, bits, g):.4f}" for g in GROUPS]
            rows.append(f"| {name} | int{bits} | " + " | ".join(cells) + " |")
    return rows


def logits_of(loaded, ids: list[int]) -> torch.Tensor:
    return loaded.model(torch.tensor([ids]), 0, loaded.model.new_cache(), loaded.experts)[0]


def fixture_table(root: Path) -> list[str]:
    rows = ["| family | experts | group | top-1 agreement | mean KL (nats) |", "|---|---|---|---|---|"]
    for family in fixtures.FAMILIES:
        source = fixtures.build_tiny_checkpoint(family, root / family)
        float_model = load_checkpoint(source)
        prompt = fixtures.make_prompt(float_model.args.vocab_size, 20)
        ids = prompt + generate(float_model.model, prompt, 32, float_model.experts).ids
        reference = logits_of(float_model, ids)
        for scheme, group in (("int4", 32), ("int4", 64), ("int8", 64)):
            dst = root / f"{family}-{scheme}-{group}"
            Converter(source, dst, ConvertOptions(experts=scheme, group_size=group, dense="f32"), progress=False).run()
            candidate = logits_of(load_container(dst), ids)
            rows.append(
                f"| {family} | {scheme} | {group} | {top1_agreement(reference, candidate):.3f} "
                f"| {mean_kl(reference, candidate):.5f} |"
            )
    return rows


def main() -> None:
    print("\n".join(matrix_table()))
    print()
    with tempfile.TemporaryDirectory() as tmp:
        print("\n".join(fixture_table(Path(tmp))))


if __name__ == "__main__":
    main()

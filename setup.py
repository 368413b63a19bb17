"""Only the C extension lives here; all metadata is in pyproject.toml.

engine.kernels._kernels (the int4/fp4, q8 and bf16 matmuls, the fused MLA decode steps and the read-ahead
thread) is optional at run time: if it cannot be built, the engine falls back to torch (slower, same
results within float rounding).
"""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """A missing compiler must not make the package uninstallable."""

    def run(self):
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any build failure means "use the torch fallback"
            print(f"warning: engine.kernels._kernels was not built ({exc}); using the slower torch path")

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            print(f"warning: engine.kernels._kernels was not built ({exc}); using the slower torch path")


# engine/csrc/<name>.c, each with its .h but kernels and py_decode (the Python entry points)
C_FILES = (
    "kernels", "bf16", "nibble", "nibble_moe", "q8", "q8_tiles", "split", "read_ahead", "q8_moe", "decode_ops",
    "mla_decode", "decode_step", "index_select", "index_choose", "py_decode",
)  # fmt: skip

setup(
    ext_modules=[
        Extension(
            "engine.kernels._kernels",
            sources=[f"engine/csrc/{name}.c" for name in C_FILES],
            depends=[f"engine/csrc/{name}.h" for name in C_FILES if name not in ("kernels", "py_decode")]
            + [
                "engine/csrc/q8_body.h",
                "engine/csrc/q8_layout.h",
                "engine/csrc/nibble_body.h",
                "engine/csrc/index_score_body.h",
                "engine/csrc/index_tile_body.h",
                "engine/csrc/index_rank.h",
                "engine/csrc/moe_terms.h",
                "engine/csrc/neon8.h",
                "engine/csrc/q8_neon.h",
            ],
            # -ffp-contract=off: no multiply and add fused unless the code says so. GCC fuses by default where
            # the target has FMA (every aarch64 CPU), which would change the plain C loops' bits there (and so
            # the NEON loops' agreement with them and with x86: tools/kernel_bits_harness.c). No -m flags: the
            # x86 SIMD loops carry their instruction sets as function attributes, so the same flags build
            # every architecture, with gcc or clang.
            extra_compile_args=["-O3", "-ffp-contract=off"],
        )
    ],
    cmdclass={"build_ext": OptionalBuildExt},
)

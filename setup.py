"""Only the C extension lives here; all metadata is in pyproject.toml.

engine/_int4 is optional at run time: if it cannot be built, the engine falls back to
dequantise-then-matmul in torch (slower, same results within float rounding).
"""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """A missing compiler must not make the package uninstallable."""

    def run(self):
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any build failure means "use the torch fallback"
            print(f"warning: engine._int4 was not built ({exc}); using the slower torch path")

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            print(f"warning: engine._int4 was not built ({exc}); using the slower torch path")


# engine/csrc/<name>.c, each with its .h but int4 and py_decode (the Python entry points)
C_FILES = ("int4", "nibble", "q8", "split", "warm", "q8_moe", "decode_ops", "mla_decode", "py_decode")

setup(
    ext_modules=[
        Extension(
            "engine._int4",
            sources=[f"engine/csrc/{name}.c" for name in C_FILES],
            depends=[f"engine/csrc/{name}.h" for name in C_FILES if name not in ("int4", "py_decode")]
            + ["engine/csrc/q8_body.h"],
            extra_compile_args=["-O3"],
        )
    ],
    cmdclass={"build_ext": OptionalBuildExt},
)

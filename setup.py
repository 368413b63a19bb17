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


setup(
    ext_modules=[
        Extension(
            "engine._int4",
            sources=["engine/csrc/int4.c", "engine/csrc/nibble.c", "engine/csrc/q8.c", "engine/csrc/split.c"],
            depends=["engine/csrc/nibble.h", "engine/csrc/q8.h", "engine/csrc/split.h"],
            extra_compile_args=["-O3"],
        )
    ],
    cmdclass={"build_ext": OptionalBuildExt},
)

"""Where the shipped demo model lives and what the demo asks of it: shared by `demo` and `bench`."""

from __future__ import annotations

from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

from colibri_stream.checkpoint.fingerprint import model_fingerprint
from colibri_stream.errors import CheckpointError
from colibri_stream.paths import user_cache_dir

DEMO_PROMPT = "import sys\n\n\ndef main():\n"
# package data of colibri_stream (pyproject's package-data), so a wheel install has it as well as a clone
DEMO_MODEL_FOLDER = "demo_model"


def demo_model_dir(package: Traversable | None = None) -> Path:
    """The shipped demo model: ``colibri_stream/demo_model``, found through the installed package."""
    path = (package or resources.files("colibri_stream")) / DEMO_MODEL_FOLDER
    # the converter and loader open files by path: a package imported from a zip has none to give
    if not isinstance(path, Path) or not (path / "config.json").is_file():
        raise CheckpointError(
            f"the demo model is missing: {path} has no config.json (reinstall colibri-stream, or remake "
            f"it in a clone with `python tools/train_demo.py colibri_stream/{DEMO_MODEL_FOLDER}`)"
        )
    return path


def demo_cache_dir() -> Path:
    return user_cache_dir("demo")


def demo_container_path(model_dir: Path, cache_dir: Path) -> Path:
    """Where the int4 container of ``model_dir`` goes. The name carries the model's fingerprint, so a
    remade demo model gets a fresh container instead of the converter refusing to mix sources."""
    return cache_dir / f"model-{model_fingerprint(model_dir)[:12]}.cstream"

"""Where the shipped demo model lives and what the demo asks of it: shared by `demo` and `bench`."""

from __future__ import annotations

from pathlib import Path

from colibri_stream.checkpoint.fingerprint import model_fingerprint
from colibri_stream.errors import CheckpointError
from colibri_stream.paths import user_cache_dir

DEMO_PROMPT = "import sys\n\n\ndef main():\n"
REPO_ROOT = Path(__file__).resolve().parents[2]  # the package is installed editable from the repository


def demo_model_dir(root: Path = REPO_ROOT) -> Path:
    """``demo/model`` of the repository this package is installed from."""
    path = root / "demo" / "model"
    if not (path / "config.json").is_file():
        raise CheckpointError(
            f"the demo model is missing: {path} has no config.json (reinstall from a clone of the "
            "repository with `pip install -e .`, or remake it with `python tools/train_demo.py`)"
        )
    return path


def demo_cache_dir() -> Path:
    return user_cache_dir("demo")


def demo_container_path(model_dir: Path, cache_dir: Path) -> Path:
    """Where the int4 container of ``model_dir`` goes. The name carries the model's fingerprint, so a
    remade demo model gets a fresh container instead of the converter refusing to mix sources."""
    return cache_dir / f"model-{model_fingerprint(model_dir)[:12]}.cstream"

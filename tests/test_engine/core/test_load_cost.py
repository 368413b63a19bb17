"""What loading a model must not pay for: values it throws away."""

from __future__ import annotations

import subprocess
import sys

import torch

from engine.core.layers import embedding

CHECK = """
import sys
from colibri_stream.runtime.loader import load_container
from storage.tiers.config import StoreConfig
loaded = load_container(sys.argv[1], store=StoreConfig(ram_bytes=10**12, preload=True))
loaded.experts.close()
print("torch._dynamo" in sys.modules)
"""


def test_loading_a_container_does_not_import_torch_dynamo(stream_container):
    """nn.Embedding's init on the meta device imports torch._dynamo (1.4-2.1 s of every load)."""
    done = subprocess.run([sys.executable, "-c", CHECK, str(stream_container)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "False"


def test_the_embedding_table_is_built_on_the_current_device_with_the_right_shape():
    with torch.device("meta"):
        table = embedding(1000, 24)
    assert table.weight.device.type == "meta" and tuple(table.weight.shape) == (1000, 24)
    assert tuple(embedding(7, 3).weight.shape) == (7, 3)

"""Where ex_engine finds its factors, manifests and hardware profiles.

The project root is the folder above this package (an editable install, or PYTHONPATH set to
a checkout). EX_ENGINE_FACTORS and EX_ENGINE_MANIFESTS override the two folders.
"""
from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def factors_dir() -> Path:
    """Default folder of plugin libraries: $EX_ENGINE_FACTORS or <root>/factors."""
    return Path(os.environ.get("EX_ENGINE_FACTORS", ROOT / "factors"))


def manifests_dir() -> Path:
    """Folder of factor manifests and hardware/: $EX_ENGINE_MANIFESTS or <root>/manifests."""
    return Path(os.environ.get("EX_ENGINE_MANIFESTS", ROOT / "manifests"))

"""Where ex_engine finds its factors, manifests and hardware profiles.

The project root is the folder above this package (an editable install, or PYTHONPATH set to
a checkout). EX_ENGINE_FACTORS and EX_ENGINE_MANIFESTS override the two folders; set to an
empty string they count as unset (as EX_ENGINE_CACHE does), so the defaults apply.
"""
from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _from_env(var: str, default: Path) -> Path:
    # an empty value is unset: Path('') is '.', the current folder, which nobody means
    return Path(os.environ.get(var) or default)


def factors_dir() -> Path:
    """Default folder of plugin libraries: $EX_ENGINE_FACTORS (when set and not empty) or
    <root>/factors."""
    return _from_env("EX_ENGINE_FACTORS", ROOT / "factors")


def manifests_dir() -> Path:
    """Folder of factor manifests and hardware/: $EX_ENGINE_MANIFESTS (when set and not empty)
    or <root>/manifests."""
    return _from_env("EX_ENGINE_MANIFESTS", ROOT / "manifests")


def not_a_checkout() -> str:
    """Why the default folders are missing, for error messages ('' where they are not): a
    non-editable install (``pip install .``) copies the package alone into site-packages, and
    the factors, manifests and Makefile stay in the checkout."""
    if os.environ.get("EX_ENGINE_MANIFESTS") or (ROOT / "manifests").is_dir():
        return ""
    return (f"ex_engine at {ROOT} is not in a checkout of its repository (no manifests/ beside "
            "the package: a plain `pip install .` copies the package alone); install it with "
            "`pip install -e <checkout>`, or set EX_ENGINE_MANIFESTS=<checkout>/manifests and "
            "EX_ENGINE_FACTORS=<checkout>/factors")


"""helm/image/build.py, imported once under a private name (helm/ is not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_NAME = "_trainpatrol_image_build"
_spec = importlib.util.spec_from_file_location(_NAME, Path(__file__).resolve().parents[2] / "helm/image/build.py")
assert _spec and _spec.loader
build = importlib.util.module_from_spec(_spec)
sys.modules[_NAME] = build  # dataclasses look their module up while the class is created
_spec.loader.exec_module(build)

"""Load another build of pyinfer's kernel extension beside the installed one (the A/B tools)."""
from __future__ import annotations

import importlib.util
from types import ModuleType


def load_kernels(path: str) -> ModuleType:
    """The compiled module at ``path`` (a ``_kernels*.so`` copied aside from a build), loaded under
    the name ``pyinfer.ops._kernels`` without replacing the imported one: a tool swaps it into
    ``pyinfer.ops.cpu._k`` to time that build. Raises ImportError/OSError for a bad file."""
    spec = importlib.util.spec_from_file_location("pyinfer.ops._kernels", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"not a loadable extension module: {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod

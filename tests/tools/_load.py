"""Loading a standalone script of ``tools/`` as a module (or a module of a tool that is a
package), for the tests of that tool."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def load_tool(name: str) -> ModuleType:
    """``tools/<name>.py`` imported as module ``name`` (registered in ``sys.modules``, where
    dataclasses and typing look modules up by name)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_tool_module(package: str, module: str) -> ModuleType:
    """``tools/<package>/<module>.py`` imported as ``<package>.<module>`` (the modules of a tool
    that is a package import each other relatively); ``tools/`` is on sys.path only while
    importing."""
    tools = str(REPO / "tools")
    sys.path.insert(0, tools)
    try:
        return importlib.import_module(f"{package}.{module}")
    finally:
        sys.path.remove(tools)

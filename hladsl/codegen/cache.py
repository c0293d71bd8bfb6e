"""On-disk cache of generated kernel modules.

An entry is ``<cache dir>/modules/<stem>_<key>.py`` where ``key`` is the
sha256 of everything the source is rendered from: the program's template
context (names, shapes, the lowered code of every term), the template text and
the hladsl / triton / torch versions. Entries are written atomically (temporary
file + ``os.replace``) and end with a sentinel line; a truncated, corrupted or
unimportable entry is regenerated. Modules are imported from their file (Triton
reads kernel source through ``inspect``). ``HLADSL_PRINT_CODE=1`` prints each
module's source when it is first loaded in this process.

The cache directory is ``$HLADSL_CACHE_DIR`` or ``~/.cache/hladsl``.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Callable

_LOADED: dict[str, ModuleType] = {}


def cache_dir() -> Path:
    root = os.environ.get("HLADSL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                "hladsl")
    return Path(root)


def versions() -> dict[str, str]:
    """Versions that key the cache, read from package metadata (the torch
    path must not import triton)."""
    from importlib.metadata import PackageNotFoundError, version

    from hladsl.version import __version__

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "absent"
    return {"hladsl": __version__, "triton": installed("triton"), "torch": installed("torch")}


def cache_key(context: dict, template: str) -> str:
    blob = json.dumps({"context": context, "template": template, "versions": versions()},
                      sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def _sentinel(key: str) -> str:
    return f"# hladsl cache entry {key} complete\n"


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _import(path: Path, module_name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module   # Triton resolves globals through the module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    return module


def load_module(stem: str, key: str, render: Callable[[], str]) -> ModuleType:
    """The module for ``key``: from this process, from the disk cache, or rendered."""
    if key in _LOADED:
        return _LOADED[key]
    path = cache_dir() / "modules" / f"{stem}_{key[:24]}.py"
    module_name = f"hladsl_generated_{stem}_{key[:24]}"
    module = None
    try:
        text = path.read_text(encoding="utf-8")
        if text.endswith(_sentinel(key)):
            module = _import(path, module_name)
    except Exception:   # missing, unreadable, corrupted or unimportable: regenerate
        module = None
    if module is None:
        text = render() + "\n" + _sentinel(key)
        _write_atomic(path, text)
        module = _import(path, module_name)
    if os.environ.get("HLADSL_PRINT_CODE", "") not in ("", "0"):
        print(f"# ---- {path}\n{text}")
    _LOADED[key] = module
    return module

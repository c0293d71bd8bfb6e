"""On-disk cache of generated kernel modules.

An entry is ``<cache dir>/modules/<stem>_<key>.py`` where ``key`` is the
sha256 of everything the source is rendered from: the program's template
context (names, shapes, the lowered code of every term), the template text and
the hladsl / triton / torch versions. An entry ends with a sentinel line holding
the key and the sha256 of the text above it; an entry that is missing, truncated,
corrupted, edited or unimportable is rendered again. Entries are written
atomically (temporary file in the same directory + ``os.replace``), so processes
sharing a cache never see half an entry, and two that render the same entry at
once both end up with a complete one. Modules are imported from their file
(Triton reads kernel source through ``inspect``). ``HLADSL_PRINT_CODE=1`` prints
each module's source when it is first loaded in this process.

The cache directory is ``$HLADSL_CACHE_DIR`` or ``~/.cache/hladsl``. If an entry
cannot be written there (read-only, not a directory, no permission, disk full),
this process uses a temporary directory instead and warns once.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path
from types import ModuleType
from typing import Callable

_LOADED: dict[str, ModuleType] = {}
_FALLBACK: dict[str, Path] = {}   # configured cache dir -> the temporary one used instead
_SENTINEL = "# hladsl cache entry "


def configured_dir() -> Path:
    root = os.environ.get("HLADSL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                "hladsl")
    return Path(root)


def cache_dir() -> Path:
    """Where entries are written: the configured directory, or this process's
    temporary stand-in once writing there has failed."""
    root = configured_dir()
    return _FALLBACK.get(str(root), root)


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


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _entry_text(source: str, key: str) -> str:
    body = source + "\n"
    return f"{body}{_SENTINEL}{key} sha256 {_digest(body)}\n"


def _is_complete(text: str, key: str) -> bool:
    """The text is an entry for ``key`` exactly as it was written."""
    body, found, tail = text.rpartition(_SENTINEL)
    return bool(found) and tail == f"{key} sha256 {_digest(body)}\n"


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


def _write_entry(name: str, text: str) -> Path:
    """Write an entry into the cache, or into the temporary stand-in (one warning
    per configured directory) when the cache cannot be written."""
    path = cache_dir() / "modules" / name
    try:
        _write_atomic(path, text)
        return path
    except OSError as exc:
        root = configured_dir()
        if str(root) in _FALLBACK:   # the stand-in itself fails: nothing left to try
            raise
        _FALLBACK[str(root)] = Path(tempfile.mkdtemp(prefix="hladsl-cache-"))
        warnings.warn(f"hladsl: cannot write generated kernels to the cache directory {root} "
                      f"({exc.strerror or exc}); using {_FALLBACK[str(root)]} for this process. "
                      f"Set HLADSL_CACHE_DIR to a writable directory to keep them.",
                      RuntimeWarning, stacklevel=3)
        return _write_entry(name, text)


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


def _cached(path: Path, key: str, module_name: str) -> ModuleType | None:
    """The module of a complete entry at ``path``, or None (missing, unreadable,
    incomplete, edited, or failing to import: render it again)."""
    try:
        if not _is_complete(path.read_text(encoding="utf-8"), key):
            return None
        return _import(path, module_name)
    except Exception:
        return None


def load_module(stem: str, key: str, render: Callable[[], str]) -> ModuleType:
    """The module for ``key``: from this process, from the disk cache, or rendered."""
    if key in _LOADED:
        return _LOADED[key]
    name = f"{stem}_{key[:24]}.py"
    module_name = f"hladsl_generated_{stem}_{key[:24]}"
    module = None
    for root in dict.fromkeys([configured_dir(), cache_dir()]):   # the stand-in's entries too
        path = root / "modules" / name
        module = _cached(path, key, module_name)
        if module is not None:
            break
    if module is None:
        path = _write_entry(name, _entry_text(render(), key))
        module = _import(path, module_name)
    if os.environ.get("HLADSL_PRINT_CODE", "") not in ("", "0"):
        print(f"# ---- {path}\n{path.read_text(encoding='utf-8')}")
    _LOADED[key] = module
    return module

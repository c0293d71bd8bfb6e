"""The kernel module cache (hladsl.codegen.cache): damaged entries are rendered
again, an unwritable cache directory falls back to a temporary one with one
warning, and processes filling one cache at the same time all succeed."""
from __future__ import annotations

import multiprocessing
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import pytest

from hladsl.codegen import cache

KEY = cache.cache_key({"program": "cache-test"}, "template")


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """An empty cache directory and a process that has loaded nothing."""
    monkeypatch.setenv("HLADSL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cache, "_LOADED", {})
    monkeypatch.setattr(cache, "_FALLBACK", {})
    return tmp_path / "cache"


class Renderer:
    def __init__(self, source: str = "VALUE = 42\n"):
        self.source, self.calls = source, 0

    def __call__(self) -> str:
        self.calls += 1
        return self.source


def load(render, stem="demo", key=KEY):
    cache._LOADED.pop(key, None)   # as a new process would
    return cache.load_module(stem, key, render)


def entry(root: Path) -> Path:
    (path,) = (root / "modules").glob("demo_*.py")
    return path


# ----------------------------------------------------------------------------- damaged entries

def _truncated(text):
    return text[:len(text) // 2]


def _edited(text):   # the body replaced, the old sentinel kept: must never run
    return "import sys\nsys.exit(3)\n" + text[text.rindex("# hladsl cache entry"):]


def _other_key(text):
    return text.replace(KEY, "0" * 64)


DAMAGE = {
    "truncated": _truncated,
    "empty": lambda text: "",
    "no sentinel": lambda text: text[:text.rindex("# hladsl cache entry")],
    "other key": _other_key,
    "edited body": _edited,
    "garbage": None,   # bytes that are not UTF-8
}


@pytest.mark.parametrize("damage", DAMAGE, ids=list(DAMAGE))
def test_damaged_entries_are_rendered_again(fresh, damage):
    render = Renderer()
    assert load(render).VALUE == 42 and render.calls == 1
    path = entry(fresh)
    good = path.read_text()
    assert load(render).VALUE == 42 and render.calls == 1   # served from disk
    if DAMAGE[damage] is None:
        path.write_bytes(b"\xff\xfe\x00garbage\x80" * 50)
    else:
        path.write_text(DAMAGE[damage](good))
    assert load(render).VALUE == 42 and render.calls == 2
    assert path.read_text() == good
    assert not list(path.parent.glob("*.tmp"))


def test_a_module_raising_at_import_is_rendered_again(fresh):
    raising = cache._entry_text("raise RuntimeError('broken entry')", KEY)   # complete, but raises
    path = fresh / "modules" / f"demo_{KEY[:24]}.py"
    path.parent.mkdir(parents=True)
    path.write_text(raising)
    render = Renderer()
    module = load(render)
    assert module.VALUE == 42 and render.calls == 1
    assert path.read_text() == cache._entry_text(render.source, KEY)
    import sys
    assert sys.modules[module.__name__] is module


def test_a_rendered_module_that_raises_raises(fresh):
    render = Renderer("raise ValueError('a bug in the generator')\n")
    with pytest.raises(ValueError, match="a bug in the generator"):
        load(render)
    import sys
    assert f"hladsl_generated_demo_{KEY[:24]}" not in sys.modules   # (other tests' modules may be)


# ----------------------------------------------------------------------------- unwritable cache

def _unwritable_run(cache_root: str, queue) -> None:
    """Load two modules with the cache at ``cache_root``: (their values, the
    warnings, where the modules live). Run in a child that may drop root."""
    if os.geteuid() == 0:
        os.setgid(65534)
        os.setuid(65534)   # nobody: permissions bind again
    os.environ["HLADSL_CACHE_DIR"] = cache_root
    cache._LOADED.clear()
    cache._FALLBACK.clear()
    readable = os.access(cache_root, os.R_OK | os.X_OK) if os.path.isdir(cache_root) else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = cache.load_module("demo", KEY, Renderer())
        b = cache.load_module("other", cache.cache_key({"x": 1}, "t"), Renderer("VALUE = 7\n"))
        again = (cache._LOADED.clear(), cache.load_module("demo", KEY, Renderer()))[1]
    queue.put(((a.VALUE, b.VALUE, again.VALUE), [str(w.message) for w in caught],
               [str(Path(m.__file__).parent.parent) for m in (a, b)], readable))


def _in_child(cache_root: Path):
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_unwritable_run, args=(str(cache_root), queue))
    proc.start()
    result = queue.get(timeout=60)
    proc.join(30)
    assert proc.exitcode == 0
    return result


def _read_only_dir(tmp_path: Path) -> Path:
    """A directory that exists and can be read but not written (by the child, which
    runs as nobody when the tests run as root); its parents can be traversed."""
    parent = Path(tempfile.mkdtemp(prefix="hladsl-ro-"))   # not under pytest's 0700 dirs
    parent.chmod(0o755)
    root = parent / "ro"
    root.mkdir()
    root.chmod(0o555)
    return root


UNWRITABLE = {
    "read-only": _read_only_dir,
    "a file": lambda tmp: (tmp / "file").write_text("") or tmp / "file",
    "under a file": lambda tmp: (tmp / "file").write_text("") or tmp / "file" / "cache",
}


@pytest.mark.parametrize("kind", UNWRITABLE, ids=list(UNWRITABLE))
def test_unwritable_cache_falls_back_with_one_warning(tmp_path, kind):
    root = UNWRITABLE[kind](tmp_path)
    values, messages, homes, readable = _in_child(root)
    assert readable is (True if kind == "read-only" else None)
    assert values == (42, 7, 42)
    assert len(messages) == 1 and str(root) in messages[0] and "HLADSL_CACHE_DIR" in messages[0]
    assert homes[0] == homes[1] and not homes[0].startswith(str(tmp_path))
    assert not (root.is_dir() and any(root.iterdir()))
    if kind == "read-only":
        shutil.rmtree(root.parent)


def test_missing_cache_directory_is_created(fresh):
    assert not fresh.exists()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load(Renderer()).VALUE == 42
    assert entry(fresh).is_file()


def test_read_only_cache_with_the_entry_is_used_as_is(tmp_path, fresh):
    load(Renderer())
    path = entry(fresh)
    path.parent.chmod(0o555)
    fresh.chmod(0o555)
    try:
        render = Renderer()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert load(render).VALUE == 42 and render.calls == 0
    finally:
        fresh.chmod(0o755)
        path.parent.chmod(0o755)


# ----------------------------------------------------------------------------- concurrency

BIG = "".join(f"# line {n} of a long generated module\n" for n in range(20000)) + "VALUE = 42\n"


def _race(root: str, barrier, queue) -> None:
    os.environ["HLADSL_CACHE_DIR"] = root
    cache._LOADED.clear()
    barrier.wait(30)
    module = cache.load_module("demo", KEY, Renderer(BIG))
    queue.put((module.VALUE, Path(module.__file__).read_text() == cache._entry_text(BIG, KEY)))


def test_four_processes_fill_one_empty_cache(tmp_path):
    # every process finds no entry, renders a 0.8 MB module and writes it at once
    ctx = multiprocessing.get_context("fork")
    barrier, queue = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_race, args=(str(tmp_path), barrier, queue)) for _ in range(4)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert results == [(42, True)] * 4
    files = sorted(p.name for p in (tmp_path / "modules").iterdir() if p.is_file())
    assert files == [f"demo_{KEY[:24]}.py"]   # one entry, no temporary file left


def _compile_linear(root: str, barrier, queue) -> None:
    import torch

    import hladsl
    os.environ["HLADSL_CACHE_DIR"] = root
    torch.set_num_threads(1)
    x = torch.randn(1, 5, 1, 4, dtype=torch.float64)
    barrier.wait(60)   # every process has imported torch: compile at the same moment
    op = hladsl.load("linear")
    o, _ = op(x, x, x)
    ref, _ = op.serial(x, x, x)
    queue.put(bool(torch.allclose(o, ref, rtol=1e-10, atol=1e-12)))


def test_four_processes_compile_one_spec_into_an_empty_cache(tmp_path):
    ctx = multiprocessing.get_context("spawn")   # fresh interpreters, as separate jobs are
    barrier, queue = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_compile_linear, args=(str(tmp_path), barrier, queue))
             for _ in range(4)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert results == [True] * 4
    modules = tmp_path / "modules"
    assert len(list(modules.glob("linear_torch_*.py"))) == 1
    assert not list(modules.glob("*.tmp"))

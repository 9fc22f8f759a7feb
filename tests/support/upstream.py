"""A framework's own test modules, run against the ledger's backends with only their fixtures
swapped (held out: the test bodies are the framework's, unchanged, never copied into this repo).

The modules come from the sdist of the installed version of the package (PyPI publishes its
tests there), fetched once with pip into a cache directory and loaded under a private name.
Their ``from tests.conftest import ...`` (the framework's own conftest: a server URI and an
embeddings class) is answered by a stand-in module while they load; the ledger's test module
then puts its own fixtures and fixture-like helpers (``_saver``, ``_create_vector_store``) in
their place, and collects the test functions it runs by name, each exclusion with its reason.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import importlib.util
import inspect
import os
import subprocess
import sys
import tarfile
import tempfile
import types
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest

CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ledger-cdc-upstream"


def sdist_tests(package: str) -> Path:
    """The ``tests/`` directory of the installed version's sdist (fetched once, then cached)."""
    version = importlib.metadata.version(package)
    name = package.replace("-", "_")
    root = CACHE / f"{name}-{version}"
    if (root / "tests").is_dir():
        return root / "tests"
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        got = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--no-binary",
                ":all:",
                "--dest",
                tmp,
                f"{package}=={version}",
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        archives = list(Path(tmp).glob("*.tar.gz"))
        if got.returncode != 0 or not archives:
            reason = f"the sdist of {package} {version} could not be fetched: {got.stderr[-500:]}"
            if os.environ.get("CI"):
                raise RuntimeError(reason)
            raise pytest.skip.Exception(reason, allow_module_level=True)
        with tarfile.open(archives[0]) as tar:
            members = [m for m in tar.getmembers() if "/tests/" in m.name and m.isfile()]
            tar.extractall(tmp, members=members, filter="data")
        unpacked = Path(tmp) / f"{name}-{version}"
        try:
            os.rename(unpacked, root)  # atomic: another worker may have put it there first
        except OSError:
            if not (root / "tests").is_dir():
                raise
    return root / "tests"


def load(tests: Path, module: str, conftest: dict[str, Any]) -> types.ModuleType:
    """Load ``tests/<module>.py`` under a private name; ``tests.conftest`` (and its
    ``tests.embed_test_utils``) answered by a stand-in holding ``conftest`` while it loads."""
    private = f"_upstream_{tests.parent.name.replace('-', '_').replace('.', '_')}"
    embed = _module(tests / "embed_test_utils.py", f"{private}.embed_test_utils")
    stand_in = types.ModuleType("tests.conftest")
    if embed is not None:
        stand_in.CharacterEmbeddings = embed.CharacterEmbeddings  # type: ignore[attr-defined]
    stand_in.__dict__.update(conftest)
    # their async tests carry pytest-asyncio's mark, which this suite does not register (it
    # runs them under anyio's plugin instead): known to the mark generator, the strict-markers
    # check lets them load
    pytest.mark._markers.add("asyncio")
    saved = {k: sys.modules.get(k) for k in ("tests.conftest", "tests.embed_test_utils")}
    sys.modules["tests.conftest"] = stand_in
    if embed is not None:
        sys.modules["tests.embed_test_utils"] = embed
    try:
        mod = _module(tests / f"{module}.py", f"{private}.{module}")
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    assert mod is not None, module
    return mod


def _module(path: Path, name: str) -> types.ModuleType | None:
    if not path.exists():
        return None
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def sync(fn: Callable[..., Any]) -> Callable[..., Any]:
    """An async test function as a sync one (no asyncio plugin here): same name, signature and
    marks, run in a loop of its own."""
    if not inspect.iscoroutinefunction(fn):
        return fn

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        return asyncio.run(fn(*args, **kwargs))

    return run


def collect(
    mod: types.ModuleType,
    into: dict[str, Any],
    excluded: dict[str, str],
    mark: Any = None,
    prefix: str = "",
) -> list[str]:
    """Put every test function of ``mod`` but the excluded ones in ``into`` (a test module's
    globals, where pytest collects them); returns their names. An exclusion that names no test
    of the module fails: the list stays true to the version under test. With ``mark`` (an
    async plugin's, e.g. ``pytest.mark.anyio``) the async ones are marked to run under it;
    without, each runs in a loop of its own. ``prefix`` renames them (``test_`` → ``prefix``),
    for two modules whose tests share names."""
    names = [n for n in vars(mod) if n.startswith("test_") and callable(getattr(mod, n))]
    unknown = set(excluded) - set(names)
    assert not unknown, f"excluded tests {mod.__name__} does not have: {sorted(unknown)}"
    taken = [n for n in names if n not in excluded]
    out = []
    for n in taken:
        fn = getattr(mod, n)
        name = prefix + n.removeprefix("test_") if prefix else n
        into[name] = mark(fn) if mark is not None and inspect.iscoroutinefunction(fn) else sync(fn)
        out.append(name)
    return out


def replace(mod: types.ModuleType, **helpers: Any) -> None:
    """Swap the module's fixture-like helpers (what its tests call to build the backend)."""
    for name, helper in helpers.items():
        assert hasattr(mod, name), f"{mod.__name__} has no {name} to replace"
        setattr(mod, name, helper)


def names(items: Iterable[str]) -> str:
    return ", ".join(sorted(items))

"""A spill directory that cannot take a file is a SpillError (a ConfigError, exit 4) naming the
path and what to do, never an internal error: at the consumer's start (ConsumerConfig.check
writes a probe there) and when a large transaction is sorted by session mid-run."""

from __future__ import annotations

import errno
import inspect
from pathlib import Path
from typing import Any

import pytest

from ledger_cdc.batching import by_session
from ledger_cdc.consumer.config import ConsumerConfig, check_spill_dir
from ledger_cdc.errors import ConfigError, SpillError


def _under_a_file(tmp_path: Path) -> Path:
    """A path no one can make a file in, root included (chmod does not stop root)."""
    plain = tmp_path / "plain"
    plain.write_text("")
    return plain / "spill"


def test_a_path_under_a_file_or_missing_is_refused_at_start(tmp_path: Path) -> None:
    for path, says in (
        (_under_a_file(tmp_path), "it is not a directory"),
        (tmp_path / "plain", "it is not a directory"),  # a file where a directory is wanted
        (tmp_path / "missing", "create it"),
    ):
        with pytest.raises(SpillError) as caught:
            ConsumerConfig(dsn="host=127.0.0.1", spill_dir=str(path)).check()
        text = str(caught.value)
        assert isinstance(caught.value, ConfigError) and caught.value.exit_code == 4
        assert text.startswith(f"spill directory {path}: ") and says in text, text
        assert "--spill-dir" in text and "LEDGER_CDC_SPILL_DIR" in text
    check_spill_dir(str(tmp_path))  # a writable one passes
    ConsumerConfig(dsn="host=127.0.0.1").check()  # none given: the system's, not probed


def test_each_cause_has_its_fix() -> None:
    full = SpillError("/spill", OSError(errno.ENOSPC, "No space left on device"), "x")
    assert "No space left on device" in str(full) and "free space there" in str(full)
    assert "--memory-limit-mb" in str(full)
    denied = SpillError("/spill", PermissionError(errno.EACCES, "Permission denied"), "x")
    assert "let the consumer's user write there" in str(denied)
    default = SpillError(None, OSError(errno.ENOSPC, "No space left on device"), "x")
    assert "(the default: TMPDIR)" in str(default)


def test_a_large_transaction_sorted_into_a_bad_directory(tmp_path: Path) -> None:
    """by_session spills a bucket past 32 changes: where it cannot, a SpillError, not an
    OSError (which the CLI called an internal error, a bug)."""
    items: list[tuple[Any, int]] = [(f"change {i}", 10) for i in range(100)]
    bad = _under_a_file(tmp_path)
    with pytest.raises(SpillError) as caught:
        _sorted(items, str(bad))
    assert f"spill directory {bad}" in str(caught.value)
    assert "sorting a large transaction by session" in str(caught.value)
    assert _sorted(items, str(tmp_path)) == items  # (changes of no session: order kept)


def _sorted(items: list[tuple[Any, int]], directory: str) -> list[tuple[Any, int]]:
    # (a memory budget too, where by_session spreads a large bucket again)
    more = (1 << 30,) if "budget" in inspect.signature(by_session).parameters else ()
    return list(by_session(items, directory, *more))  # type: ignore[arg-type]

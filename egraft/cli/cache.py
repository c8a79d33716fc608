"""The ``egraft cache`` commands: where the compile cache is, how big, clear it.

Example:
    egraft cache show
    egraft cache clear
"""

from __future__ import annotations

import typer

from egraft.cli.common import console, fail

cache_app = typer.Typer(help="The compile cache: where it is, how big, clear it.", no_args_is_help=True)


@cache_app.command("show")
def cache_show() -> None:
    """Where the cache is, what it holds and its size cap."""
    from egraft.errors import EgraftError
    from egraft.kernels.cpu.llvm import cache_dir, cache_max_bytes

    try:
        cap = cache_max_bytes()
    except EgraftError as e:
        raise fail(str(e)) from None
    root = cache_dir()
    files = [p for p in root.rglob("*") if p.is_file()] if root.is_dir() else []
    size = sum(p.stat().st_size for p in files)
    console.print(f"{root}: {len(files)} files, {size / 2**20:.1f} MiB (at most {cap / 2**20:.0f} MiB: "
                  "$EGRAFT_CACHE_MAX; the least recently used entries go first)")


@cache_app.command("clear")
def cache_clear() -> None:
    """Delete every compiled model and object file in the cache."""
    from egraft.compiler import clear_cache

    console.print(f"removed {clear_cache()} files")


__all__ = ["cache_app", "cache_show", "cache_clear"]

"""A helper process of :func:`egraft.kernels.cpu.llvm.compile_objects`: it reads LLVM
modules from its standard input and writes their object code to its standard output, one
at a time, until its input closes. Each message is an 8-byte little-endian length and
that many bytes; a length of 2**64 - 1 answers a module it could not compile (the parent
then compiles it itself, and reports the error).

Run as ``python -m egraft.kernels.cpu.object_worker`` (it imports llvmlite, nothing else of egraft's).
"""

from __future__ import annotations

import struct
import subprocess
import sys
from typing import BinaryIO

_FAILED = 2**64 - 1


def send(stream: BinaryIO, data: bytes | None) -> None:
    """Write one message (``None``: the failure answer)."""
    stream.write(struct.pack("<Q", _FAILED if data is None else len(data)))
    if data is not None:
        stream.write(data)
    stream.flush()


def receive(stream: BinaryIO) -> bytes | None:
    """Read one message; ``None`` for the failure answer or a closed stream."""
    head = stream.read(8)
    if len(head) < 8:
        return None
    (size,) = struct.unpack("<Q", head)
    if size == _FAILED:
        return None
    data = stream.read(size)
    return data if len(data) == size else None


class Helper:
    """One helper process, seen from its parent: :meth:`compile` hands it a module and returns
    its object code (``None`` when it could not: the parent compiles that module itself).
    Starting one raises ``OSError`` where no process can be started.

    Example::

        >>> helper = Helper()                        # doctest: +SKIP
        >>> data = helper.compile(module_text)       # doctest: +SKIP
        >>> helper.close()                           # doctest: +SKIP
    """

    def __init__(self) -> None:
        self.process = subprocess.Popen([sys.executable, "-m", "egraft.kernels.cpu.object_worker"],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def compile(self, module_text: str) -> bytes | None:
        try:
            send(self.process.stdin, module_text.encode())
            return receive(self.process.stdout)
        except OSError:  # the helper died
            return None

    def close(self) -> None:
        try:
            self.process.stdin.close()
        except OSError:
            pass
        self.process.wait()


def main() -> None:
    from egraft.kernels.cpu.llvm import object_code

    source, sink = sys.stdin.buffer, sys.stdout.buffer
    while (text := receive(source)) is not None:
        try:
            data = object_code(text.decode())
        except Exception:  # noqa: BLE001 - the parent compiles it again and reports the error
            data = None
        send(sink, data)


if __name__ == "__main__":
    main()

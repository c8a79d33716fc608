"""Compiling kernels while lowering still emits the next ones.

Lowering is Python (emitting a model's kernels: ResNet-50's took 0.8 s) and compiling is
LLVM (1.3 s more); one after the other they left the second core idle for the first part.
Within a session (:func:`begin` ... :func:`end`, on one thread), :func:`submit` hands
each new kernel module to a helper process (:mod:`egraft.kernels.cpu.object_worker`) at
once, and :func:`egraft.kernels.cpu.llvm.compile_objects` later takes the objects made so
far, compiles what is still queued itself beside the helper, and waits for the rest.

A session starts only where a second core exists and none is under way (control-flow
bodies are lowered inside their model's lowering); the lowered model holds it, and
compiling that model ends it. A session that nobody ends (lowering without compiling)
stops its helper after :data:`IDLE_SECONDS` idle.

Example::

    >>> session = begin(True)                               # doctest: +SKIP
    >>> submit(object_key(text), text)                      # doctest: +SKIP
    >>> detach(session)                                     # doctest: +SKIP
    >>> compile_objects([text], early=session)              # doctest: +SKIP  (the helper's object)
    >>> end(session)                                        # doctest: +SKIP
"""

from __future__ import annotations

import threading
from collections import deque

#: A helper with nothing to do for this long stops (a session that was never ended).
IDLE_SECONDS = 20.0

_local = threading.local()


class Session:
    """The modules submitted in one lowering: queued, being compiled by the helper, or done."""

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.queue: deque[tuple[str, str]] = deque()  # (object key, module text), not yet taken
        self.running: set[str] = set()
        self.done: dict[str, bytes | None] = {}  # None: the helper could not compile it
        self.known: set[str] = set()
        self.closed = False
        self.helper: threading.Thread | None = None

    def submit(self, key: str, text: str) -> None:
        with self.lock:
            if self.closed or key in self.known:
                return
            self.known.add(key)
            self.queue.append((key, text))
            self.lock.notify_all()
            if self.helper is None:
                self.helper = threading.Thread(target=self._serve, name="egraft-early-compile", daemon=True)
                self.helper.start()

    def _next(self) -> tuple[str, str] | None:
        with self.lock:
            while not self.queue and not self.closed:
                if not self.lock.wait(timeout=IDLE_SECONDS):
                    self.closed = True
            if not self.queue:
                return None
            key, text = self.queue.popleft()
            self.running.add(key)
            return key, text

    def _finish(self, key: str, data: bytes | None) -> None:
        with self.lock:
            self.running.discard(key)
            self.done[key] = data
            self.lock.notify_all()

    def _serve(self) -> None:
        from egraft.kernels.cpu.object_worker import Helper

        try:
            helper = Helper()
        except OSError:
            return  # no helper: compile_objects compiles everything here
        try:
            while (job := self._next()) is not None:
                key, text = job
                reply = helper.compile(text)
                self._finish(key, reply)
                if reply is None:
                    return  # a broken helper: what is left is compiled by compile_objects
        finally:
            helper.close()

    def take_all(self, compile_here) -> dict[str, bytes]:
        """Every object made or still to make: compiles the queued modules here (``compile_here``,
        text -> bytes) while the helper works, waits for the helper's last, and closes the session."""
        while True:
            with self.lock:
                if not self.queue:
                    break
                key, text = self.queue.popleft()
                self.running.add(key)
            self._finish(key, compile_here(text))
        with self.lock:
            self.closed = True
            self.lock.notify_all()
            while self.running:
                self.lock.wait()
            return {k: v for k, v in self.done.items() if v is not None}

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.queue.clear()
            self.lock.notify_all()


def begin(helpers_available: bool) -> Session | None:
    """Start a session on this thread; ``None`` (nothing started) with one core or when one
    is under way already (a control-flow body lowered inside its model's lowering)."""
    if current() is not None or not helpers_available:
        return None
    _local.session = Session()
    return _local.session


def detach(session: Session | None) -> None:
    """Lowering is over: ``session`` takes no more modules from this thread's lowerings; it
    goes on compiling what it has (for the :class:`~egraft.lowering.compile.Lowered` that holds it)."""
    if session is not None and current() is session:
        _local.session = None


def end(session: Session | None) -> None:
    """Stop ``session`` (its helper finishes the module it is on and exits)."""
    if session is None:
        return
    session.close()
    detach(session)


def current() -> Session | None:
    """The session of the lowering under way on this thread, if any."""
    return getattr(_local, "session", None)


def submit(key: str, text: str) -> None:
    """Start compiling ``text`` (object key ``key``) in the helper, when a session is under way."""
    session = current()
    if session is not None:
        session.submit(key, text)

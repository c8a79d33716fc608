"""The zoo's result store: one SQLite file that holds every run and every model's row.

Several ``egraft zoo run`` processes may share one file: it is in WAL mode, writers wait
for each other (a 60 s busy timeout), and each row is its own transaction, committed the
moment its model finishes, so a ``kill -9`` of the parent loses no finished row.

Tables (``PRAGMA user_version`` = :data:`SCHEMA_VERSION`):

- ``runs(name, created, updated, settings)``: ``settings`` is the JSON of the run's options.
- ``results(run, model, key, status, finished, row, plan)``: one row per (run, model);
  ``key`` is the content hash that decides whether a rerun may skip the model
  (:func:`egraft.zoo.jobs.job_key`), ``row`` the JSON object ``zoo show --json`` prints
  (:data:`ROW_FIELDS`), ``plan`` the plan JSON of the optimize stage.

Example:
    >>> store = ZooStore(":memory:")
    >>> store.begin_run("r1", {"threads": 1})
    >>> store.put("r1", {"model": "m", "key": "k", "status": "ok", "finished": "2026-01-01T00:00:00+00:00"})
    >>> [r["status"] for r in store.rows("r1")]
    ['ok']
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from egraft.errors import EgraftError

SCHEMA_VERSION = 1
#: Every model's outcome is one of these; only ``ok`` is a success.
STATUSES = ("ok", "mismatch", "error", "timeout", "crashed")
#: The fields of a row, in the order ``zoo show --json`` prints them. A stage that did not
#: run leaves its fields ``None``.
ROW_FIELDS = (
    "model",            # the model's name in the run (corpus name, bundled name, path relative to its folder)
    "source",           # where it came from: a file path
    "sha256",           # of the model file's bytes
    "key",              # content hash of model, rule files, settings and egraft's source
    "status",           # ok | mismatch | error | timeout | crashed
    "error",            # the error text, or the signal that killed the process; None when ok
    "stage",            # the stage that failed (load, optimize, compile, check, bench)
    "worker",           # host:pid of the process that supervised the model (a Dask worker's, or this host's)
    "process",          # host:pid of the isolated process that ran it
    "started",          # ISO 8601, UTC
    "finished",         # ISO 8601, UTC
    "wall_s",           # seconds from start to finish, process start-up included
    "bindings",         # the symbolic dims bound for the check and bench stages
    "nodes_before",     # IR nodes as imported
    "nodes_after",      # IR nodes of the extracted program
    "enodes", "eclasses", "iterations", "stop_reason",   # the e-graph after saturation
    "optimize_s",       # load + saturate + extract
    "compile_s",        # lowering + code generation + LLVM
    "kernels",          # steps that run generated code
    "fallbacks",        # steps left on numpy reference kernels
    "fallback_reasons",  # [[node, op, reason], ...]
    "predicted_ms",     # the cost model's latency estimate (roofline only)
    "egraft_ms",        # median latency, compiled, at `threads`
    "onnxruntime_ms",   # median latency, onnxruntime (all graph optimizations), at `threads`
    "speedup",          # onnxruntime_ms / egraft_ms (above 1: egraft is faster)
    "threads",
    "max_error",        # scale-relative error against onnxruntime (worst output, worst binding)
    "tolerance",
    "rules",            # rule name -> applications (only rules that fired)
)


def now_iso() -> str:
    """The current time, UTC, ISO 8601 with seconds: ``2026-12-04T22:15:03+00:00``."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass(frozen=True)
class RunInfo:
    """One run of a store: its name, when it was made and last written, its settings,
    and how many of its rows have each status."""

    name: str
    created: str
    updated: str
    settings: dict
    counts: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.counts.values())


class ZooStore:
    """A zoo result database (created when missing). Raises :class:`EgraftError` for a
    file that is not an SQLite database or not an egraft zoo store."""

    def __init__(self, path: str | Path, create: bool = True):
        self.path = path
        where = str(path)
        if where != ":memory:":
            p = Path(path)
            if p.is_dir():
                raise EgraftError(f"--db {p}: is a folder; give a file path for the database")
            if not p.exists() and not create:
                raise EgraftError(f"--db {p}: no such database (egraft zoo run makes one)")
            if not p.exists():
                try:
                    p.parent.mkdir(parents=True, exist_ok=True)
                except OSError as e:
                    raise EgraftError(f"--db {p}: cannot create its folder: {e.strerror}") from None
        try:
            self._db = sqlite3.connect(where, timeout=60.0, isolation_level=None)
            self._db.row_factory = sqlite3.Row
            if where != ":memory:":
                self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._setup()
        except sqlite3.DatabaseError as e:
            raise EgraftError(f"--db {path}: not a usable SQLite database ({e})") from None

    def _setup(self) -> None:
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        tables = {r[0] for r in self._db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if version == 0 and not tables:
            self._db.executescript(f"""
                BEGIN;
                CREATE TABLE IF NOT EXISTS runs (
                    name TEXT PRIMARY KEY, created TEXT NOT NULL, updated TEXT NOT NULL, settings TEXT NOT NULL);
                CREATE TABLE IF NOT EXISTS results (
                    run TEXT NOT NULL REFERENCES runs(name), model TEXT NOT NULL, key TEXT NOT NULL,
                    status TEXT NOT NULL, finished TEXT NOT NULL, row TEXT NOT NULL, plan TEXT,
                    PRIMARY KEY (run, model));
                PRAGMA user_version = {SCHEMA_VERSION};
                COMMIT;""")
            return
        if version != SCHEMA_VERSION or not {"runs", "results"} <= tables:
            raise EgraftError(f"--db {self.path}: not an egraft zoo database (schema version {version}, "
                              f"tables {sorted(tables)}); give another --db path")

    def close(self) -> None:
        self._db.close()

    def _sql(self, query: str, params: tuple = ()) -> sqlite3.Cursor:
        """Execute ``query``; an SQLite failure (locked past the busy timeout, disk full, a
        file damaged under us) is an :class:`EgraftError` naming the database."""
        try:
            return self._db.execute(query, params)
        except sqlite3.Error as e:
            raise EgraftError(f"--db {self.path}: {e}") from None

    # ---- runs ----------------------------------------------------------------------------------
    def begin_run(self, name: str, settings: dict) -> None:
        """Create run ``name``, or record new ``settings`` for it (its rows stay)."""
        stamp = now_iso()
        self._sql(
            "INSERT INTO runs(name, created, updated, settings) VALUES (?, ?, ?, ?) "
            "ON CONFLICT(name) DO UPDATE SET updated = excluded.updated, settings = excluded.settings",
            (name, stamp, stamp, json.dumps(settings, sort_keys=True)))

    def runs(self) -> list[RunInfo]:
        """Every run, oldest first."""
        counts: dict[str, dict[str, int]] = {}
        for r in self._sql("SELECT run, status, COUNT(*) FROM results GROUP BY run, status"):
            counts.setdefault(r[0], {})[r[1]] = r[2]
        return [RunInfo(r["name"], r["created"], r["updated"], json.loads(r["settings"]), counts.get(r["name"], {}))
                for r in self._sql("SELECT * FROM runs ORDER BY created, name")]

    def run(self, name: str) -> RunInfo:
        """Run ``name``; EgraftError naming the runs there are when it does not exist."""
        for info in self.runs():
            if info.name == name:
                return info
        known = [r.name for r in self.runs()]
        raise EgraftError(f"no run {name!r} in {self.path}; " +
                          (f"its runs: {', '.join(known)}" if known else "it has no runs yet"))

    def latest_run(self) -> str:
        """The name of the run written last; EgraftError when there is none."""
        row = self._sql("SELECT name FROM runs ORDER BY updated DESC, created DESC LIMIT 1").fetchone()
        if row is None:
            raise EgraftError(f"{self.path} has no runs yet (egraft zoo run makes one)")
        return row[0]

    # ---- rows ----------------------------------------------------------------------------------
    def put(self, run: str, row: dict, plan: str | None = None) -> None:
        """Write (or replace) ``row`` of ``run``, committed at once (one transaction)."""
        self._sql("BEGIN IMMEDIATE")
        try:
            self._sql(
                "INSERT OR REPLACE INTO results(run, model, key, status, finished, row, plan) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (run, row["model"], row["key"], row["status"], row["finished"], json.dumps(row), plan))
            self._sql("UPDATE runs SET updated = ? WHERE name = ?", (now_iso(), run))
        except BaseException:
            self._db.rollback()
            raise
        self._sql("COMMIT")

    def rows(self, run: str) -> list[dict]:
        """The rows of ``run``, by model name, each with every field of :data:`ROW_FIELDS`."""
        out = []
        for r in self._sql("SELECT row FROM results WHERE run = ? ORDER BY model", (run,)):
            stored = json.loads(r[0])
            out.append({f: stored.get(f) for f in ROW_FIELDS} | {k: v for k, v in stored.items()
                                                                  if k not in ROW_FIELDS})
        return out

    def finished_keys(self, run: str) -> dict[str, str]:
        """model -> key of the rows ``run`` already has."""
        return {r[0]: r[1] for r in self._sql("SELECT model, key FROM results WHERE run = ?", (run,))}

    def plan(self, run: str, model: str) -> dict | None:
        """The plan document the optimize stage stored for ``model`` in ``run``, if any."""
        r = self._sql("SELECT plan FROM results WHERE run = ? AND model = ?", (run, model)).fetchone()
        return json.loads(r[0]) if r and r[0] else None


__all__ = ["SCHEMA_VERSION", "STATUSES", "ROW_FIELDS", "RunInfo", "ZooStore", "now_iso"]

"""A zoo run: which models need running, running them (local processes or a Dask
cluster), and writing each row to the store the moment it finishes.

Keys: a row is skipped on a rerun of the same run name when its key is unchanged. The key
is the SHA-256 of the model file's bytes, the model's description (inputs, bindings,
tolerance), the contents of the extra rule files, every setting that can change a row
(stages, threads, rule sets off, cost model, extractor, ``--shape``, bench time) and
egraft's own source (:func:`egraft.compile_cache._source_digest`: an edited egraft
recomputes everything). The limits (timeout, memory cap) are not in it: a rerun with a
larger one recomputes only the rows that hit the smaller one. ``force`` recomputes every
model.

Executors: ``jobs`` threads here, each supervising one model process at a time
(:func:`egraft.zoo.isolate.run_isolated`); or, given a Dask scheduler address, one task
per model on the cluster, where the task supervises the model's process on its worker
(Dask has no per-task timeout; the process does). A Dask task that fails (its worker
died) is a ``crashed`` row.

Example:
    >>> settings = ZooSettings(stages=["check"], threads=1)
    >>> rows = run_zoo(resolve_sources(["squeezenet"]), settings, ZooStore("z.sqlite"), "r1")  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path

from egraft.errors import EgraftError
from egraft.zoo.isolate import kill_running, run_isolated
from egraft.zoo.job import STAGES, expand_stages
from egraft.zoo.sources import ZooModel
from egraft.zoo.store import ZooStore, now_iso


@dataclass
class ZooSettings:
    """Everything but the models that decides a run's rows (see the CLI for each option)."""

    stages: list[str] = field(default_factory=lambda: list(STAGES))
    threads: int = 1
    rules: list[str] = field(default_factory=list)
    rules_off: list[str] = field(default_factory=list)
    cost_model: str = "roofline"
    extractor: str = "greedy"
    shape: dict[str, int] = field(default_factory=dict)
    timeout: float = 900.0
    max_memory_gb: float | None = None
    bench_seconds: float = 2.0

    def __post_init__(self) -> None:
        self.stages = expand_stages(self.stages)
        if self.threads < 1:
            raise EgraftError(f"--threads {self.threads}: give 1 or more")
        if self.timeout <= 0:
            raise EgraftError(f"--timeout {self.timeout:g}: give a positive number of seconds")
        if self.max_memory_gb is not None and self.max_memory_gb <= 0:
            raise EgraftError(f"--max-memory {self.max_memory_gb:g}: give a positive number of GB")
        for path in self.rules:
            if not Path(path).is_file():
                raise EgraftError(f"--rules {path}: no such file")
        self.rules = [str(Path(p).resolve()) for p in self.rules]  # Dask workers run elsewhere

    def as_dict(self) -> dict:
        return asdict(self)

    def rule_digests(self) -> list[str]:
        """SHA-256 of each extra rule file's contents."""
        out = []
        for path in self.rules:
            try:
                out.append(hashlib.sha256(Path(path).read_bytes()).hexdigest())
            except OSError as e:
                raise EgraftError(f"--rules {path}: cannot read it: {e.strerror}") from None
        return out


def file_sha256(path: Path) -> str | None:
    """SHA-256 of a file's bytes, ``None`` when it cannot be read."""
    from egraft.testing.corpus import file_sha256 as sha256_of

    try:
        return sha256_of(path)
    except OSError:
        return None


#: Settings outside the key: a row keeps its limits (``limits``), and a rerun with a larger
#: one recomputes the rows that hit them (:func:`hit_a_raised_limit`).
LIMITS = ("timeout", "max_memory_gb")


def hit_a_raised_limit(row: dict, settings: ZooSettings) -> bool:
    """Whether a finished row ran out of a limit that ``settings`` now raises: a
    ``timeout`` under a shorter ``--timeout``, or an out-of-memory (``MemoryError``, or a
    SIGKILL) under a smaller ``--max-memory``."""
    limits = row.get("limits") or {}
    if row["status"] == "timeout":
        return (limits.get("timeout") or 0) < settings.timeout
    error = row.get("error") or ""
    if row["status"] in ("error", "crashed") and ("MemoryError" in error or "SIGKILL" in error):
        was, now = limits.get("max_memory_gb"), settings.max_memory_gb
        return was is not None and (now is None or was < now)
    return False


def job_key(model: ZooModel, sha256: str | None, settings: ZooSettings) -> str:
    """The content hash that decides whether a finished row can be kept (module docstring)."""
    from egraft.compile_cache import _source_digest

    described = {"inputs": model.inputs, "bindings": model.bindings, "tolerance": model.tolerance}
    settings_part = {k: v for k, v in settings.as_dict().items() if k not in ("rules", *LIMITS)}
    text = json.dumps({"model": sha256, "described": described, "rules": settings.rule_digests(),
                       "settings": settings_part, "egraft": _source_digest()}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _local(todo: Sequence[ZooModel], job_settings: dict, timeout: float, jobs: int) -> Iterator[tuple[ZooModel, dict]]:
    with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="egraft-zoo") as pool:
        futures = {pool.submit(run_isolated, m.spec(), job_settings, timeout): m for m in todo}
        try:
            for future in as_completed(futures):
                yield futures[future], future.result()
        except BaseException:  # Ctrl-C, or the consumer stopped: no model keeps running
            for f in futures:
                f.cancel()
            kill_running()
            raise


def _dask(todo: Sequence[ZooModel], job_settings: dict, timeout: float, address: str,
          say: Callable[[str], None]) -> Iterator[tuple[ZooModel, dict]]:
    try:
        from distributed import Client
        from distributed import as_completed as dask_completed
    except ImportError:
        raise EgraftError("--dask needs Dask distributed: pip install 'dask[distributed]'") from None
    try:
        client = Client(address, timeout="20s")
    except (OSError, TimeoutError, ValueError) as e:
        raise EgraftError(f"--dask {address}: cannot reach the scheduler ({e})") from None
    try:
        try:
            client.wait_for_workers(1, timeout=60)
        except TimeoutError:
            raise EgraftError(f"--dask {address}: the scheduler has no workers (waited 60 s)") from None
        workers = client.scheduler_info().get("workers", {})
        say(f"Dask scheduler {address}: {len(workers)} worker(s)")
        futures = {client.submit(run_isolated, m.spec(), job_settings, timeout, pure=False,
                                 key=f"egraft-zoo-{m.name}-{os.urandom(4).hex()}"): m for m in todo}
        for future in dask_completed(list(futures)):
            model = futures[future]
            try:
                yield model, future.result()
            except Exception as err:  # the worker died under the task, or the task could not run
                yield model, {"status": "crashed", "stage": None, "worker": None,
                              "error": f"Dask task failed: {type(err).__name__}: {err}",
                              "finished": now_iso(), "tolerance": model.tolerance, "threads": job_settings["threads"]}
        for f in futures:
            f.cancel()
    finally:
        client.close()


def run_zoo(models: Sequence[ZooModel], settings: ZooSettings, store: ZooStore, name: str, *, jobs: int = 1,
            dask: str | None = None, force: bool = False, sources: Sequence[str] = (),
            on_plan: Callable[[int, int], None] | None = None,
            on_row: Callable[[dict, bool], None] | None = None,
            say: Callable[[str], None] = lambda _: None) -> list[dict]:
    """Run ``models`` under ``settings`` as run ``name`` of ``store``; returns their rows,
    in the order of ``models``. ``on_plan(to_run, skipped)`` is called once before any
    model runs; ``on_row(row, skipped)`` once per model, as it finishes (or at once when
    its finished row is kept)."""
    if jobs < 1:
        raise EgraftError(f"--jobs {jobs}: give 1 or more")
    store.begin_run(name, {**settings.as_dict(), "sources": list(sources)})
    finished = store.finished_keys(name)
    kept = {r["model"]: r for r in store.rows(name)}
    todo: list[ZooModel] = []
    keys: dict[str, tuple[str, str | None]] = {}
    immediate: list[dict] = []
    skipped: list[dict] = []
    for m in models:
        sha = file_sha256(m.path)
        key = job_key(m, sha, settings)
        keys[m.name] = (key, sha)
        if not force and finished.get(m.name) == key and not hit_a_raised_limit(kept[m.name], settings):
            skipped.append(kept[m.name])
        elif m.problem or sha is None:
            stamp = now_iso()
            immediate.append({"model": m.name, "source": str(m.path), "sha256": sha, "key": key, "status": "error",
                              "stage": "load", "error": m.problem or f"{m.path}: no such file or not readable",
                              "started": stamp, "finished": stamp, "tolerance": m.tolerance,
                              "threads": settings.threads})
        else:
            todo.append(m)
    if on_plan:
        on_plan(len(todo) + len(immediate), len(skipped))
    for row in skipped:
        if on_row:
            on_row(row, True)
    for row in immediate:
        store.put(name, row)
        if on_row:
            on_row(row, False)
    job_settings = {k: v for k, v in settings.as_dict().items() if k != "timeout"}
    runs = _dask(todo, job_settings, settings.timeout, dask, say) if dask else \
        _local(todo, job_settings, settings.timeout, jobs)
    for m, outcome in runs:
        key, sha = keys[m.name]
        plan = outcome.pop("plan", None)
        row = {"model": m.name, "source": str(m.path), "sha256": sha, "key": key, **outcome,
               "limits": {"timeout": settings.timeout, "max_memory_gb": settings.max_memory_gb}}
        store.put(name, row, plan)
        if on_row:
            on_row(row, False)
    rows = {r["model"]: r for r in store.rows(name)}
    return [rows[m.name] for m in models if m.name in rows]


__all__ = ["ZooSettings", "run_zoo", "job_key", "file_sha256", "hit_a_raised_limit", "LIMITS"]

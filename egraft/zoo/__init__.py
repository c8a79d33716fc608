"""Batch optimization of model zoos: ``egraft zoo``.

The pipeline, one module each:

- :mod:`egraft.zoo.sources`: SOURCE arguments (folders, manifests, the corpus, bundled
  names) to the list of models;
- :mod:`egraft.zoo.inputs`: inputs for models nobody described;
- :mod:`egraft.zoo.job`: the stages one model goes through, inside its own process;
- :mod:`egraft.zoo.isolate`: that process: timeout, memory cap, crash classification;
- :mod:`egraft.zoo.run`: keys, resume, the local and Dask executors;
- :mod:`egraft.zoo.store`: the SQLite result store;
- :mod:`egraft.zoo.report` (and its :mod:`egraft.zoo.charts`) and :mod:`egraft.zoo.diff`:
  the HTML/Markdown report and run diffs.

Example:
    >>> from egraft.zoo import ZooSettings, ZooStore, resolve_sources, run_zoo   # doctest: +SKIP
    >>> models = resolve_sources(["bundled"])                                       # doctest: +SKIP
    >>> rows = run_zoo(models, ZooSettings(), ZooStore("zoo.sqlite"), "nightly", jobs=2)  # doctest: +SKIP
"""

from egraft.zoo.run import ZooSettings, run_zoo
from egraft.zoo.sources import ZooModel, resolve_sources
from egraft.zoo.store import ROW_FIELDS, STATUSES, ZooStore

__all__ = ["ZooSettings", "run_zoo", "ZooModel", "resolve_sources", "ZooStore", "ROW_FIELDS", "STATUSES"]

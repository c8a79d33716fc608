"""Plans: the result of extraction as a versioned JSON document that can be saved,
shown, explained and compared.

A plan holds the chosen graph (each node's op, attributes, input and output values with
their types, its estimated cost and work, the source-model nodes it covers, the rules
that produced it and the alternatives the extractor rejected), the total cost, the
e-graph statistics, the settings (rule files with their hashes, target, cost model and
profile, extractor, budgets, egraft version) and the time spent in each stage.

Format ``egraft-plan``, version :data:`PLAN_VERSION`; the layout is documented in
``docs/plans.md``. The same inputs give the same plan byte for byte, except the
``timings`` section (seconds measured in this run) and, when the ILP's time limit stopped
HiGHS, the extraction's ``gap`` and ``lower_bound`` (the bound HiGHS had proven when the
clock ran out); :func:`plan_json` with ``timings=False`` leaves those out.

Example:
    >>> result = optimize(graph, cost="roofline", extractor="ilp")      # doctest: +SKIP
    >>> plan = build_plan(result)                                     # doctest: +SKIP
    >>> Path("plan.json").write_text(plan_json(plan))                 # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from egraft.errors import EgraftError
from egraft.extract.provenance import Provenance, rules, sources
from egraft.ir.graph import Graph, content_hash

PLAN_FORMAT = "egraft-plan"
PLAN_VERSION = 1
#: Rejected alternatives kept per plan node (the cheapest ones).
MAX_ALTERNATIVES = 8
SHIPPED_RULES = Path(__file__).resolve().parent.parent / "rules"


def _number(x: float) -> float | int | None:
    """A cost as JSON: integers stay integers, floats are rounded to 6 significant digits
    (estimates, and a stable printed form); ``None`` for an infinite one (an e-node
    extraction must not pick)."""
    if isinstance(x, int | np.integer):
        return int(x)
    x = float(x)
    if not np.isfinite(x):
        return None
    if x == int(x) and abs(x) < 2**53:
        return int(x)
    return float(f"{x:.6g}")


def _attr_json(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return {"tensor": content_hash(v), "dtype": str(v.dtype), "shape": list(v.shape)}
    if isinstance(v, Graph):
        return {"graph": v.name}
    if isinstance(v, list | tuple):
        return [_attr_json(x) for x in v]
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, float | np.floating):
        return float(v)
    if isinstance(v, bytes):
        return v.decode(errors="replace")
    return v


def _rule_file_entry(f) -> dict:
    path = Path(f.path).resolve()
    shown = f"egraft/rules/{path.name}" if path.parent == SHIPPED_RULES else str(f.path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else f.source_hash
    return {"path": shown, "ruleset": f.ruleset, "rules": len(f.rules), "sha256": digest}


def _source_label(graph: Graph, index: int) -> dict:
    node = graph.nodes[index]
    return {"index": index, "op": node.op if not node.domain else f"{node.domain}::{node.op}", "name": node.name,
            "outputs": [v.name for v in node.outputs if v is not None]}


def build_plan(result, model_label: str | None = None, extractor_time_limit: float | None = None) -> dict:
    """The plan document of an :class:`egraft.optimize.OptimizeResult`."""
    from egraft import __version__

    snapshot, extraction, model = result.snapshot, result.extraction, result.cost_model
    if snapshot is None or extraction is None or model is None:
        raise EgraftError("build_plan needs the result of optimize() (its snapshot and extraction)")
    source: Graph = result.source
    graph: Graph = result.graph
    provenance = Provenance(snapshot)
    table, alternatives = extraction.table, extraction.alternatives
    nodes_json = []
    covered: set[int] = set()
    for k, (node, c) in enumerate(zip(graph.nodes, result.node_classes)):
        entry: dict[str, Any] = {
            "id": f"n{k}",
            "op": f"{node.domain}::{node.op}" if node.domain else node.op,
            "attrs": {a: _attr_json(node.attrs[a]) for a in sorted(node.attrs)},
            "inputs": [None if v is None else v.name for v in node.inputs],
            "outputs": [{"name": v.name, "type": str(v.type)} for v in node.outputs if v is not None],
        }
        if c < 0:  # an Identity that renames an output
            entry.update(cost=0, covers=[], rules=[], derivation=None, alternatives=[])
            nodes_json.append(entry)
            continue
        i = extraction.choice[c]
        enode = snapshot.classes[c][i]
        work = model.work(snapshot, c, enode)
        derivation = provenance.derivation(enode)
        covers = sources(derivation)
        covered.update(covers)
        rejected = []
        for j, other in enumerate(snapshot.classes[c]):
            if j == i or other.op in ("Const", "Input", "Absent"):
                continue
            rejected.append({"op": f"{other.domain}::{other.op}" if other.domain else other.op,
                             "cost": _number(table[c][j]),
                             "subtree_cost": _number(alternatives[(c, j)]) if (c, j) in alternatives else None,
                             "rules": rules(provenance.derivation(other))})
        rejected.sort(key=lambda r: (r["subtree_cost"] is None, r["subtree_cost"] or 0, r["op"]))
        entry.update(
            cost=_number(table[c][i]),
            subtree_cost=_number(alternatives[(c, i)]) if (c, i) in alternatives else None,
            work={"flops": _number(work.flops), "bytes": _number((work.reads or 0) + (work.writes or 0)),
                  "family": work.family, "launches": work.launches},
            covers=covers, rules=rules(derivation), derivation=derivation,
            alternatives=rejected[:MAX_ALTERNATIVES])
        nodes_json.append(entry)
    report = result.saturation
    budget = result.budget
    extraction_json = {
        "extractor": extraction.extractor, "status": extraction.status,
        "gap": None if extraction.gap is None else _number(extraction.gap),
        "lower_bound": None if extraction.lower_bound is None else _number(extraction.lower_bound),
        "problem": dict(sorted(extraction.problem.items())),
    }
    if extraction.extractor == "ilp":
        extraction_json["time_limit"] = result.time_limit if extractor_time_limit is None else extractor_time_limit
    return {
        "format": PLAN_FORMAT,
        "version": PLAN_VERSION,
        "model": {"name": model_label or source.name, "graph": source.name,
                  "ir_sha256": hashlib.sha256(str(source).encode()).hexdigest(),
                  "nodes": len(source.nodes), "ops": source.op_histogram()},
        "settings": {
            "egraft_version": __version__,
            "target": getattr(getattr(model, "profile", None), "target", "cpu"),
            "cost_model": model.settings(),
            "extractor": extraction.extractor,
            "rule_files": [_rule_file_entry(f) for f in result.rule_files],
            "rulesets": list(result.rulesets),
            "rules_off": sorted(result.rules_off),
            "bindings": dict(sorted(result.bindings.items())),
            "budget": {"iterations": budget.iterations, "max_nodes": budget.max_nodes, "seconds": budget.seconds,
                       "match_limit": budget.match_limit, "ban_length": budget.ban_length},
        },
        "egraph": {"iterations": report.iterations, "stop_reason": report.stop_reason,
                   "enodes_before": report.nodes_before, "enodes": report.nodes_after,
                   "eclasses": report.classes_after,
                   "rules_applied": {k: v.applied for k, v in sorted(report.rules.items()) if v.applied}},
        "extraction": extraction_json,
        "cost": {"total": _number(extraction.cost), "unit": model.unit},
        "graph": {
            "name": graph.name,
            "inputs": [{"name": v.name, "type": str(v.type)} for v in graph.inputs],
            "outputs": [{"name": v.name, "type": str(v.type)} for v in graph.outputs],
            "nodes": nodes_json,
            "ops": graph.op_histogram(),
            "ir": str(graph),
        },
        "source": [_source_label(source, k) for k in range(len(source.nodes))],
        "eliminated": [k for k in range(len(source.nodes)) if k not in covered],
        "timings": {k: round(v, 4) for k, v in result.seconds.items()},
    }


def plan_json(plan: dict, timings: bool = True) -> str:
    """The plan as JSON text (keys in document order, 1-space indents, a final newline);
    ``timings=False`` leaves out what depends on the clock (see the module's docstring)."""
    body = plan if timings else {k: v for k, v in plan.items() if k != "timings"}
    extraction = body.get("extraction", {})
    if not timings and str(extraction.get("status", "")).startswith("time limit"):
        body = {**body, "extraction": {k: v for k, v in extraction.items() if k not in ("gap", "lower_bound")}}
    return json.dumps(body, indent=1, ensure_ascii=False) + "\n"


def load_plan(path: str | Path) -> dict:
    """Read a plan file; a file that is not a plan (or of a newer version) is refused by name."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise EgraftError(f"{path}: no such plan file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise EgraftError(f"{path}: not a plan (not JSON: {e})") from None
    if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
        raise EgraftError(f"{path}: not an egraft plan (no \"format\": \"{PLAN_FORMAT}\"); write one with egraft plan")
    if not isinstance(data.get("version"), int) or data["version"] > PLAN_VERSION:
        raise EgraftError(f"{path}: plan version {data.get('version')!r}; this egraft reads versions up to "
                          f"{PLAN_VERSION}")
    return data


def find_node(plan: dict, ref: str) -> dict:
    """A plan node by id (``n12``), by the name of one of its outputs, or by the index or
    name of a source node it covers (``source:12``)."""
    nodes = plan["graph"]["nodes"]
    for node in nodes:
        if node["id"] == ref or any(o["name"] == ref for o in node["outputs"]):
            return node
    if ref.startswith("source:") and ref[7:].isdigit():
        index = int(ref[7:])
        for node in nodes:
            if index in node["covers"]:
                return node
    for node in nodes:
        if any(plan["source"][k]["name"] == ref or ref in plan["source"][k]["outputs"] for k in node["covers"]):
            return node
    ids = ", ".join(n["id"] for n in nodes[:5])
    raise EgraftError(f"no node {ref!r} in the plan: give a node id ({ids}, ...), an output name, or "
                      "source:INDEX of a source node it covers (egraft show PLAN lists them)")


def plan_settings(plan: dict, plan_path: str | Path = "plan") -> dict:
    """What it takes to extract ``plan`` again: the model's path, the user rule files (each
    checked against the SHA-256 the plan recorded), rule sets off, bound dims, the cost
    model (with the plan's own profile figures), extractor, time limit and budget.

    Raises :class:`EgraftError` naming what no longer matches (a missing model, an edited
    rule file).
    """
    from egraft.extract.cost import cost_model
    from egraft.extract.profiles import Profile
    from egraft.rewrite.engine import Budget
    from egraft.testing.models import model_path

    settings = plan["settings"]
    name = plan["model"]["name"]
    try:
        path = model_path(name)
    except EgraftError:
        path = None
    if path is None or not path.exists():
        raise EgraftError(f"{plan_path}: its model {name!r} is not a file here nor a bundled model")
    rules = []
    for entry in settings["rule_files"]:
        if entry["path"].startswith("egraft/rules/"):
            continue  # shipped: part of egraft's version
        rule_path = Path(entry["path"])
        if not rule_path.is_file():
            raise EgraftError(f"{plan_path}: rule file {entry['path']} is gone")
        if hashlib.sha256(rule_path.read_bytes()).hexdigest() != entry["sha256"]:
            raise EgraftError(f"{plan_path}: rule file {entry['path']} changed since the plan was made; "
                              "make the plan again (egraft plan)")
        rules.append(str(rule_path))
    model_settings = settings["cost_model"]
    bindings = dict(settings["bindings"])
    if model_settings["name"] == "roofline":
        p = model_settings["profile"]
        profile = Profile(p["name"], p["target"], p["peak_gflops"], p["bandwidth_gbs"], p["launch_us"],
                          dict(p["efficiency"]), dict(p.get("bandwidth_efficiency", {})),
                          call_us=dict(p.get("call_us", {})), source=p.get("source", ""))
        model = cost_model("roofline", profile, p["target"], bindings)
    else:
        model = cost_model(model_settings["name"], bindings=bindings)
    budget = Budget(**settings["budget"])
    return {"model": path, "rules": rules, "rules_off": list(settings["rules_off"]), "bindings": bindings,
            "cost": model, "extractor": settings["extractor"],
            "time_limit": plan["extraction"].get("time_limit", 30.0), "budget": budget}

"""Comparing two plans (``egraft diff``) and explaining one node of a plan (``egraft explain``).

Nodes of two plans of the same model are matched through the source nodes they cover:
a region is a set of source nodes that some node of either plan covers together, so a
``FusedConv`` covering Conv, BatchNormalization and Relu in one plan faces the ``Conv``
and ``Relu`` covering the same three nodes in the other, and their costs compare.

Example:
    >>> d = diff_plans(load_plan("a.json"), load_plan("b.json"))     # doctest: +SKIP
    >>> d["cost"]["difference"]                                      # doctest: +SKIP
"""

from __future__ import annotations

from collections import Counter


def _signature(node: dict) -> tuple:
    return (node["op"], tuple(node["covers"]))


def _rules_used(plan: dict) -> set[str]:
    return {r for n in plan["graph"]["nodes"] for r in n.get("rules", ())}


def _regions(a: dict, b: dict) -> list[tuple[list[dict], list[dict]]]:
    """Groups of nodes (of ``a``, of ``b``) that cover overlapping source nodes."""
    parent: dict = {}

    def find(x):
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def join(x, y):
        parent[find(x)] = find(y)

    tagged = [("a", n) for n in a["graph"]["nodes"]] + [("b", n) for n in b["graph"]["nodes"]]
    for side, n in tagged:
        key = (side, n["id"])
        find(key)
        for s in n["covers"]:
            join(key, ("source", s))
        if not n["covers"]:
            join(key, ("uncovered", n["op"]))
    groups: dict = {}
    for side, n in tagged:
        groups.setdefault(find((side, n["id"])), ([], []))[0 if side == "a" else 1].append(n)
    return list(groups.values())


def diff_plans(a: dict, b: dict, top: int = 5) -> dict:
    """What differs between plans ``a`` and ``b``: total cost, op counts, nodes on one side
    only, rules used on one side only, and the ``top`` regions whose cost differs most."""
    sig_a = Counter(_signature(n) for n in a["graph"]["nodes"])
    sig_b = Counter(_signature(n) for n in b["graph"]["nodes"])
    only_a = [n for n in a["graph"]["nodes"] if sig_a[_signature(n)] > sig_b.get(_signature(n), 0)]
    only_b = [n for n in b["graph"]["nodes"] if sig_b[_signature(n)] > sig_a.get(_signature(n), 0)]
    ops = sorted(set(a["graph"]["ops"]) | set(b["graph"]["ops"]))
    rules_a, rules_b = _rules_used(a), _rules_used(b)
    regions = []
    for nodes_a, nodes_b in _regions(a, b):
        cost_a = sum(n["cost"] for n in nodes_a)
        cost_b = sum(n["cost"] for n in nodes_b)
        if cost_a == cost_b and [n["op"] for n in nodes_a] == [n["op"] for n in nodes_b]:
            continue
        regions.append({"a": [f"{n['id']} {n['op']}" for n in nodes_a], "b": [f"{n['id']} {n['op']}" for n in nodes_b],
                        "cost_a": cost_a, "cost_b": cost_b, "difference": cost_b - cost_a,
                        "sources": sorted({s for n in nodes_a + nodes_b for s in n["covers"]})})
    regions.sort(key=lambda r: (-abs(r["difference"]), r["sources"][:1], r["a"]))
    same_model = a["model"]["ir_sha256"] == b["model"]["ir_sha256"]
    unit_a, unit_b = a["cost"]["unit"], b["cost"]["unit"]
    return {
        "same_model": same_model,
        "cost": {"a": a["cost"]["total"], "b": b["cost"]["total"], "unit_a": unit_a, "unit_b": unit_b,
                 "difference": b["cost"]["total"] - a["cost"]["total"] if unit_a == unit_b else None},
        "settings": {k: [_short_setting(a, k), _short_setting(b, k)] for k in ("cost_model", "extractor", "rulesets",
                                                                              "target")},
        "ops": [{"op": op, "a": a["graph"]["ops"].get(op, 0), "b": b["graph"]["ops"].get(op, 0)} for op in ops],
        "only_a": [{"id": n["id"], "op": n["op"], "covers": n["covers"], "cost": n["cost"]} for n in only_a],
        "only_b": [{"id": n["id"], "op": n["op"], "covers": n["covers"], "cost": n["cost"]} for n in only_b],
        "rules_only_a": sorted(rules_a - rules_b),
        "rules_only_b": sorted(rules_b - rules_a),
        "top_differences": regions[:top],
    }


def _short_setting(plan: dict, key: str):
    value = plan["settings"].get(key)
    if key == "cost_model":
        profile = value.get("profile", {}).get("name")
        return f"{value['name']} ({profile})" if profile else value["name"]
    if isinstance(value, list):
        return ", ".join(value)
    return value


def explain_node(plan: dict, node: dict) -> dict:
    """Where ``node`` came from: the source nodes it covers, the chain of rules (as a
    derivation tree and as a list), and the alternatives the extractor rejected."""
    source = plan["source"]
    return {
        "id": node["id"], "op": node["op"], "outputs": node["outputs"], "cost": node["cost"],
        "subtree_cost": node.get("subtree_cost"), "unit": plan["cost"]["unit"], "work": node.get("work"),
        "covers": [source[k] for k in node["covers"]],
        "rules": node.get("rules", []),
        "derivation": node.get("derivation"),
        "alternatives": node.get("alternatives", []),
    }


def derivation_lines(derivation: dict | None, source: list[dict], indent: str = "") -> list[str]:
    """A derivation tree as indented text lines, the newest rule first."""
    if derivation is None:
        return [indent + "(an input or constant)"]
    if "source" in derivation:
        s = source[derivation["source"]]
        name = f" {s['name']!r}" if s["name"] else ""
        return [f"{indent}source node #{s['index']} {s['op']}{name} -> {', '.join(s['outputs'])}"]
    head = f"{indent}rule {derivation['rule']}"
    if derivation.get("truncated"):
        return [head + " (deeper steps left out)"]
    lines = [head + f" (round {derivation['iteration']}) rewrote:"]
    for sub in derivation.get("from", ()):
        lines += derivation_lines(sub, source, indent + "  ")
    return lines

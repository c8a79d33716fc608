"""Where an e-node came from: the source node that loaded it, or the rule application
that built it from the e-nodes it matched (and, recursively, where those came from).

The e-graph state logs every term it adds with the application that added it (or
``SOURCE`` for the loaded model) and, per application, the e-nodes the rule matched. An
e-node of a snapshot is found in that log by its op, attributes and child e-classes; the
first term that produced it is its origin.

Example:
    >>> prov = Provenance(snapshot)                         # doctest: +SKIP
    >>> prov.derivation(c, node)                            # doctest: +SKIP
    {'rule': 'fuse_conv_relu', 'iteration': 2, 'from': [{'source': 3}, {'rule': 'fold_bn_into_conv', ...}]}
"""

from __future__ import annotations

from egraft.rewrite.egraph import SOURCE, ENode, Snapshot

#: Derivations deeper than this are cut (``{"truncated": true}``).
MAX_DEPTH = 24


class Provenance:
    """Origins of the e-nodes of one snapshot."""

    def __init__(self, snapshot: Snapshot):
        self.snap = snapshot
        state = snapshot.state
        ref_class = snapshot.ref_class
        self._first: dict[tuple, tuple[int, int]] = {}
        for ref, name, attrs, args, app in state.term_log:
            if ref not in ref_class or any(a not in ref_class for a in args):
                continue
            key = (name, attrs, tuple(ref_class[a] for a in args))
            self._first.setdefault(key, (ref, app))
        self._memo: dict[tuple, dict | None] = {}

    @staticmethod
    def _key(node: ENode) -> tuple:
        return (f"{node.domain}::{node.op}" if node.domain else node.op, node.attrs, node.children)

    def origin(self, node: ENode) -> tuple[int, int] | None:
        """(handle, application) of the first term that produced ``node``."""
        return self._first.get(self._key(node))

    def derivation(self, node: ENode) -> dict | None:
        """``{"source": index}`` for a node of the loaded model, ``{"rule", "iteration",
        "from": [...]}`` for one a rule built, ``None`` for a leaf (input, constant)."""
        return self._derive(self._key(node), 0, frozenset())

    def _derive(self, key: tuple, depth: int, visiting: frozenset) -> dict | None:
        if key in self._memo:
            return self._memo[key]
        found = self._first.get(key)
        if found is None:
            return None
        ref, app = found
        state = self.snap.state
        if app == SOURCE:
            index = state.ref_source.get(ref)
            result = None if index is None else {"source": index}
        elif depth >= MAX_DEPTH or key in visiting:
            return {"rule": state.applications[app].rule, "truncated": True}
        else:
            application = state.applications[app]
            parts = []
            for _cref, name, attrs, child_refs in application.matched:
                child_key = (name, attrs, tuple(self.snap.ref_class.get(r, -1) for r in child_refs))
                sub = self._derive(child_key, depth + 1, visiting | {key})
                if sub is not None and sub not in parts:
                    parts.append(sub)
            result = {"rule": application.rule, "iteration": application.iteration, "from": parts}
        self._memo[key] = result
        return result


def sources(derivation: dict | None) -> list[int]:
    """The source-node indices at the leaves of a derivation, sorted."""
    out: set[int] = set()

    def walk(d):
        if d is None:
            return
        if "source" in d:
            out.add(d["source"])
        for sub in d.get("from", ()):
            walk(sub)

    walk(derivation)
    return sorted(out)


def rules(derivation: dict | None) -> list[str]:
    """The rules of a derivation, earliest application first, each once."""
    seen: list[str] = []

    def walk(d):
        if d is None:
            return
        for sub in d.get("from", ()):
            walk(sub)
        if "rule" in d and d["rule"] not in seen:
            seen.append(d["rule"])

    walk(derivation)
    return seen

"""The rewrite engine: IR <-> e-graph (egglog), the rule language, saturation, extraction."""

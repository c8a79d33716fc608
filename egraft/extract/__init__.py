"""Extraction: cost models and extractors that turn an e-graph back into an IR graph."""

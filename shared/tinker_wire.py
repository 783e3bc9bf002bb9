"""The Tinker API's three protobuf payloads: the forward_backward request (decoded and checked
by the API, decoded again by the worker), its ForwardBackwardOutput, and SampleResponse.

The SDK (tinker 0.38) always speaks protobuf for these three, with no JSON fallback; the schema is
its `tinker_public.proto`, written out below as a table and built into message classes at import
time, through a private descriptor pool (so nothing clashes with a `tinker_public` the SDK
registers in the default pool of the same process, as in the tests).

| payload                | direction         | content                                              |
|------------------------|-------------------|------------------------------------------------------|
| ForwardBackwardRequest | SDK -> API/worker | datums: int32 token bytes per text chunk, and        |
|                        |                   | loss_fn_inputs: Tensor{dtype, shape, dense or CSR}   |
| ForwardBackwardOutput  | worker -> SDK     | one ArrayRecord: per field, the datums' arrays       |
|                        |                   | concatenated, int64 byte offsets (num_datums + 1)    |
| SampleResponse         | worker -> SDK     | per sequence int32 tokens, float32 logprobs, stop    |

A request is refused (WireError, naming the datum and the field) when it does not parse; has no
datums or too many, or too many tokens in all; a datum has no tokens, a negative token id, or an
image or audio chunk; a loss_fn input has a dtype other than float32/int64, bytes that do not fill
its shape, non-finite values, a first dimension other than the datum's token count, too many
values per token, or CSR indices that are out of range or inconsistent. Which inputs a loss needs
is the worker's to check.

All numbers on the wire are little-endian. Bodies arrive uncompressed: the SDK zstd-compresses
forward_backward only when /client/config says `proto_compress_fwdbwd`, which this server never
does.
"""

import math
import re
from dataclasses import dataclass
from typing import Literal

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError

PACKAGE = "tinker_public"

ENUMS = {  # values numbered from 0 in this order
    "StopReason": ("STOP_REASON_STOP", "STOP_REASON_LENGTH"),
    "DType": ("DTYPE_UNSPECIFIED", "DTYPE_FLOAT32", "DTYPE_INT64", "DTYPE_INT32", "DTYPE_BFLOAT16"),
}

# The fields the SDK sends or reads, written as in the .proto. Fields it never touches
# (SamplingParams, top-k logprobs, prompt alt tokens, image dimensions) are left out: the
# parser keeps unknown fields aside, and we never send them.
MESSAGES = {
    "ForwardBackwardRequest": (
        "string model_id = 1", "int32 seq_id = 2", "repeated Datum data = 3", "string loss_fn = 4",
        "map<string,double> loss_fn_config = 5", "bool forward_only = 6",
        "map<string,LossConfigValue> loss_fn_config_v2 = 7"),
    "LossConfigValue": ("oneof value: double number = 1", "oneof value: string text = 2"),
    "Datum": (
        "repeated Chunk model_input = 1", "map<string,Tensor> loss_fn_inputs = 2",
        "repeated ProvenanceSpan model_input_spans = 3", "repeated ProvenanceSpan loss_fn_input_spans = 4"),
    "Chunk": (
        "oneof chunk: EncodedTextChunk encoded_text = 1", "oneof chunk: ImageChunk image = 2",
        "oneof chunk: DmelChunk dmel = 3"),
    "EncodedTextChunk": ("bytes tokens = 1",),
    "ImageChunk": ("bytes data = 1", "string format = 2", "optional int32 expected_tokens = 3"),
    "DmelChunk": ("bytes dmel = 1",),
    "Tensor": (
        "oneof encoding: bytes dense = 1", "oneof encoding: SparseCsr sparse_csr = 2",
        "DType dtype = 3", "repeated int64 shape = 4"),
    "SparseCsr": ("bytes values = 1", "bytes crow_indices = 2", "bytes col_indices = 3"),
    "ProvenanceSpan": (
        "oneof span: PromptProvenanceSpan prompt_tokens = 1", "oneof span: SampledProvenanceSpan sampled_tokens = 2"),
    "PromptProvenanceSpan": ("string sequence_id = 1", "int64 offset = 2", "int64 length = 3"),
    "SampledProvenanceSpan": ("string sequence_id = 1", "int64 offset = 2", "int64 length = 3"),
    "ForwardBackwardOutput": (
        "string loss_fn_output_type = 1", "repeated ArrayRecord loss_fn_outputs = 2",
        "map<string,double> metrics = 3"),
    "ArrayRecord": ("string type_tag = 1", "map<string,BatchedTensor> fields = 2", "int64 num_datums = 3"),
    "BatchedTensor": ("bytes data = 1", "bytes offsets = 2", "DType dtype = 3", "repeated int64 trailing_shape = 4"),
    "SampleResponse": (
        "repeated SampledSequence sequences = 1", "optional bytes prompt_logprobs = 2",
        "int32 prompt_cache_hit_tokens = 4"),
    "SampledSequence": ("StopReason stop_reason = 1", "bytes tokens = 2", "optional bytes logprobs = 3"),
}

_FIELD = re.compile(r"(?:oneof (\w+): )?(?:(repeated|optional) )?(\S+) (\w+) = (\d+)")
_FDP = descriptor_pb2.FieldDescriptorProto
_SCALARS = {name: getattr(_FDP, f"TYPE_{name.upper()}") for name in ("double", "int32", "int64", "bool", "string", "bytes")}


def _set_type(field: descriptor_pb2.FieldDescriptorProto, type_name: str) -> None:
    if type_name in _SCALARS:
        field.type = _SCALARS[type_name]
    else:
        field.type = _FDP.TYPE_ENUM if type_name in ENUMS else _FDP.TYPE_MESSAGE
        field.type_name = f".{PACKAGE}.{type_name}"


def _map_entry(message: descriptor_pb2.DescriptorProto, field_name: str, key_type: str, value_type: str) -> str:
    """The type of a map field, as protoc makes it: a nested FooEntry {key = 1; value = 2} marked map_entry."""
    entry = message.nested_type.add(name="".join(p.capitalize() for p in field_name.split("_")) + "Entry")
    entry.options.map_entry = True
    for number, (name, type_name) in enumerate((("key", key_type), ("value", value_type)), 1):
        _set_type(entry.field.add(name=name, number=number, label=_FDP.LABEL_OPTIONAL), type_name)
    return f"{message.name}.{entry.name}"


def _file_descriptor() -> descriptor_pb2.FileDescriptorProto:
    """ENUMS and MESSAGES as the FileDescriptorProto protoc would write for the .proto."""
    file = descriptor_pb2.FileDescriptorProto(name=f"{PACKAGE}.proto", package=PACKAGE, syntax="proto3")
    for name, values in ENUMS.items():
        enum = file.enum_type.add(name=name)
        for number, value in enumerate(values):
            enum.value.add(name=value, number=number)
    for name, fields in MESSAGES.items():
        message = file.message_type.add(name=name)
        optionals = []
        for spec in fields:
            oneof, label, type_name, field_name, number = _FIELD.fullmatch(spec).groups()
            field = message.field.add(name=field_name, number=int(number), label=_FDP.LABEL_OPTIONAL)
            if map_types := re.fullmatch(r"map<(\w+),(\w+)>", type_name):
                label, type_name = "repeated", _map_entry(message, field_name, *map_types.groups())
            _set_type(field, type_name)
            if label == "repeated":
                field.label = _FDP.LABEL_REPEATED
            if oneof:
                if oneof not in [o.name for o in message.oneof_decl]:
                    message.oneof_decl.add(name=oneof)
                field.oneof_index = [o.name for o in message.oneof_decl].index(oneof)
            if label == "optional":
                optionals.append(field)
        for field in optionals:  # proto3 `optional`: a synthetic oneof of its own, after the real ones
            field.proto3_optional = True
            field.oneof_index = len(message.oneof_decl)
            message.oneof_decl.add(name=f"_{field.name}")
    return file


_POOL = descriptor_pool.DescriptorPool()
_POOL.Add(_file_descriptor())


def _message_class(name: str) -> type:
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"{PACKAGE}.{name}"))


ForwardBackwardRequest = _message_class("ForwardBackwardRequest")
ForwardBackwardOutput = _message_class("ForwardBackwardOutput")
SampleResponse = _message_class("SampleResponse")

DTYPE = {name: number for number, name in enumerate(ENUMS["DType"])}
STOP_REASON = {name.removeprefix("STOP_REASON_").lower(): number  # "stop", "length": as the SDK names them
               for number, name in enumerate(ENUMS["StopReason"])}

# Wire dtypes a request's tensors may have (the SDK sends only these two), little-endian.
_TENSOR_DTYPES = {DTYPE["DTYPE_FLOAT32"]: np.dtype("<f4"), DTYPE["DTYPE_INT64"]: np.dtype("<i8")}
# Values per row of a loss_fn input (the product of its dimensions after the first): a sparse
# tensor could otherwise declare a dense shape far larger than its bytes. (N, K) inputs are
# top-K targets and their weights; the cookbook's distillation uses K = 20.
MAX_ROW_VALUES = 128
TARGET_TOKENS = "target_tokens"  # the one integer input: token ids, int64
# The reductions the SDK knows when it merges the metrics of a chunked forward_backward
# (tinker/lib/chunked_fwdbwd_helpers.py): it drops a metric with any other, and crashes on a
# key without exactly one colon.
METRIC_REDUCTIONS = ("mean", "sum", "min", "max", "slack", "hash2", "unique")
RECORD_TYPE = "ArrayRecord"  # loss_fn_output_type (the SDK keeps what follows its last ':') and type_tag


class WireError(ValueError):
    """A request body that is not a forward_backward call this server can run."""


@dataclass(frozen=True, eq=False)  # eq=False: numpy arrays do not compare to a bool
class WireDatum:
    tokens: np.ndarray  # int32 (N,): the model input, all text chunks concatenated
    inputs: dict[str, np.ndarray]  # loss_fn_inputs by name, dense: int64 target_tokens, float32 the others; first dim N


@dataclass(frozen=True)
class ForwardBackwardCall:
    model_id: str
    seq_id: int
    loss_fn: str
    config: dict[str, float | str]
    forward_only: bool
    data: list[WireDatum]


@dataclass(frozen=True)
class Sequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: Literal["stop", "length"]


def decode_forward_backward(body: bytes, *, max_datums: int, max_tokens: int) -> ForwardBackwardCall:
    """Parse and check a ForwardBackwardRequest body. `max_tokens` bounds the tokens of all
    datums together (the compute of one call), `max_datums` their number."""
    request = ForwardBackwardRequest()
    try:
        request.ParseFromString(body)
    except DecodeError as e:
        raise WireError(f"the body is not a ForwardBackwardRequest protobuf: {e}") from None
    if not request.data:
        raise WireError("data: no datums")
    if len(request.data) > max_datums:
        raise WireError(f"data: {len(request.data)} datums, more than the limit of {max_datums}")
    data, total = [], 0
    for i, datum in enumerate(request.data):
        total += sum(len(chunk.encoded_text.tokens) for chunk in datum.model_input) // 4  # before any decoding
        if total > max_tokens:
            raise WireError(f"data[{i}].model_input: {total} tokens in data[0..{i}], more than the limit of "
                            f"{max_tokens} for all datums together")
        data.append(_datum(datum, f"data[{i}]"))
    return ForwardBackwardCall(model_id=request.model_id, seq_id=request.seq_id, loss_fn=request.loss_fn,
                               config=_config(request), forward_only=request.forward_only, data=data)


def _config(request) -> dict[str, float | str]:
    """loss_fn_config_v2 (numbers or text) over the legacy loss_fn_config (numbers): the SDK
    writes numbers to both, text to v2 only."""
    config: dict[str, float | str] = dict(request.loss_fn_config)
    for key, value in request.loss_fn_config_v2.items():
        kind = value.WhichOneof("value")
        if kind is None:
            raise WireError(f"loss_fn_config_v2[{key[:100]!r}]: neither a number nor a text")
        config[key] = getattr(value, kind)
    for key, value in config.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise WireError(f"loss_fn_config[{key[:100]!r}]: {value} is not a finite number")
    return config


def _datum(datum, where: str) -> WireDatum:
    chunks = []
    for j, chunk in enumerate(datum.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise WireError(f"{where}.model_input[{j}]: an empty chunk" if kind is None else
                            f"{where}.model_input[{j}]: a {kind} chunk; images and audio are not supported "
                            "by this server, only encoded_text")
        chunks.append(_array(chunk.encoded_text.tokens, np.dtype("<i4"), f"{where}.model_input[{j}].tokens"))
    tokens = np.concatenate(chunks).astype(np.int32) if chunks else np.zeros(0, np.int32)
    if not len(tokens):
        raise WireError(f"{where}.model_input: no tokens")
    if (tokens < 0).any():
        raise WireError(f"{where}.model_input: negative token ids")
    inputs = {name: _loss_fn_input(name, tensor, len(tokens), f"{where}.loss_fn_inputs[{name[:100]!r}]")
              for name, tensor in datum.loss_fn_inputs.items()}
    return WireDatum(tokens=tokens, inputs=inputs)


def _loss_fn_input(name: str, tensor, n: int, where: str) -> np.ndarray:
    """A loss_fn input, dense, one row per input token (position i predicts target_tokens[i])."""
    dtype = _TENSOR_DTYPES.get(tensor.dtype)
    if dtype is None:
        raise WireError(f"{where}: dtype {tensor.dtype} is not float32 or int64")
    sparse = tensor.WhichOneof("encoding") == "sparse_csr"
    values = _array(tensor.sparse_csr.values if sparse else tensor.dense, dtype, where)
    shape = tuple(tensor.shape) or (None if sparse else (len(values),))  # no shape: a dense 1-D tensor
    if shape is None:
        raise WireError(f"{where}: a sparse tensor without its shape")
    if min(shape) < 0:
        raise WireError(f"{where}: shape {list(shape)} has a negative dimension")
    if shape[0] != n:
        raise WireError(f"{where}: shape {list(shape)}, its first dimension is not the datum's {n} tokens")
    if math.prod(shape[1:]) > MAX_ROW_VALUES:
        raise WireError(f"{where}: shape {list(shape)}, more than {MAX_ROW_VALUES} values per token")
    if dtype.kind == "f" and not np.isfinite(values).all():
        raise WireError(f"{where}: values that are not finite")
    array = _densify(tensor.sparse_csr, values, shape, where) if sparse else _reshape(values, shape, where)
    if name != TARGET_TOKENS:
        return array.astype(np.float32)
    if dtype.kind != "i":
        raise WireError(f"{where}: token ids must be int64, not float32")
    if (array < 0).any():
        raise WireError(f"{where}: negative token ids")
    return array.astype(np.int64)


def _array(data: bytes, dtype: np.dtype, where: str) -> np.ndarray:
    if len(data) % dtype.itemsize:
        raise WireError(f"{where}: {len(data)} bytes, not a whole number of {dtype.itemsize}-byte values")
    return np.frombuffer(data, dtype)


def _reshape(values: np.ndarray, shape: tuple[int, ...], where: str) -> np.ndarray:
    if math.prod(shape) != len(values):
        raise WireError(f"{where}: shape {list(shape)} holds {math.prod(shape)} values, the bytes {len(values)}")
    return values.reshape(shape)


def _densify(csr, values: np.ndarray, shape: tuple[int, ...], where: str) -> np.ndarray:
    """A sparse CSR matrix, dense, 0 where nothing is listed (the SDK's pad value). Its indices
    must be torch's CSR invariants: row pointers from 0 to nnz, not decreasing; in each row,
    columns in range and strictly increasing."""
    if len(shape) != 2:
        raise WireError(f"{where}: a sparse CSR tensor of shape {list(shape)}, not 2-D")
    rows, cols = shape
    crow = _array(csr.crow_indices, np.dtype("<i8"), f"{where}.crow_indices")
    col = _array(csr.col_indices, np.dtype("<i8"), f"{where}.col_indices")
    if len(crow) != rows + 1 or crow[0] != 0 or crow[-1] != len(values) or (np.diff(crow) < 0).any():
        raise WireError(f"{where}.crow_indices: not {rows + 1} non-decreasing row pointers from 0 to {len(values)}")
    if len(col) != len(values) or ((col < 0) | (col >= cols)).any():
        raise WireError(f"{where}.col_indices: not {len(values)} column indices in [0, {cols})")
    row_of = np.repeat(np.arange(rows), np.diff(crow))
    if (np.diff(col)[row_of[1:] == row_of[:-1]] <= 0).any():
        raise WireError(f"{where}.col_indices: columns not strictly increasing within a row")
    dense = np.zeros(shape, values.dtype)
    dense[row_of, col] = values
    return dense


def encode_forward_backward_output(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """One ArrayRecord: for each output name, the datums' arrays (float -> float32, int -> int64)
    concatenated, with num_datums + 1 byte offsets, and the shape past the first dimension
    (the same for every datum) as trailing_shape. Bad keys or arrays are a programming error
    (ValueError): the SDK would crash on them or drop them."""
    for key in metrics:
        if key.count(":") != 1 or key.split(":")[1] not in METRIC_REDUCTIONS:
            raise ValueError(f"metric {key!r}: keys are name:reduction, reduction one of {METRIC_REDUCTIONS}")
    message = ForwardBackwardOutput(loss_fn_output_type=RECORD_TYPE, metrics={k: float(v) for k, v in metrics.items()})
    record = message.loss_fn_outputs.add(type_tag=RECORD_TYPE, num_datums=len(outputs))
    names = list(outputs[0]) if outputs else []
    if any(set(output) != set(names) for output in outputs):
        raise ValueError("every datum's outputs must have the same names")
    for name in names:
        arrays = [np.asarray(output[name]) for output in outputs]
        kinds = {a.dtype.kind for a in arrays}
        trailing = {a.shape[1:] for a in arrays}
        if kinds not in ({"f"}, {"i"}) or len(trailing) != 1 or min(a.ndim for a in arrays) == 0:
            raise ValueError(f"output {name!r}: arrays of one kind (float or int) and one shape past the first "
                             f"dimension, got {sorted(kinds)} {sorted(trailing)}")
        dtype, wire = (np.dtype("<f4"), "DTYPE_FLOAT32") if kinds == {"f"} else (np.dtype("<i8"), "DTYPE_INT64")
        chunks = [a.astype(dtype).tobytes() for a in arrays]
        field = record.fields[name]
        field.data = b"".join(chunks)
        field.offsets = np.cumsum([0] + [len(c) for c in chunks], dtype="<i8").tobytes()
        field.dtype = DTYPE[wire]
        field.trailing_shape.extend(trailing.pop())
    return message.SerializeToString()


def encode_sample_response(sequences: list[Sequence], prompt_logprobs: list[float | None] | None = None) -> bytes:
    """The sampled sequences (int32 tokens, float32 logprobs of the same length), and the
    prompt's logprobs when asked for: one per prompt token, NaN (or None) where none was
    computed, at least position 0; the SDK reads NaN back as None."""
    message = SampleResponse()
    for sequence in sequences:
        if len(sequence.logprobs) != len(sequence.tokens):
            raise ValueError(f"{len(sequence.tokens)} tokens but {len(sequence.logprobs)} logprobs")
        message.sequences.add(stop_reason=STOP_REASON[sequence.stop_reason],
                              tokens=np.asarray(sequence.tokens, "<i4").tobytes(),
                              logprobs=np.asarray(sequence.logprobs, "<f4").tobytes())
    if prompt_logprobs is not None:
        values = [math.nan if p is None else p for p in prompt_logprobs]
        message.prompt_logprobs = np.asarray(values, "<f4").tobytes()
    return message.SerializeToString()

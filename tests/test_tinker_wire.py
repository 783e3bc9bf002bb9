"""shared/tinker_wire.py against the official tinker SDK (0.38), the reference: requests built
with the SDK's public types and serialized by its own converter (tinker/proto/request_conv.py,
as tinker/resources/training.py sends them) are decoded by ours; what we encode is read back
by its own response converters (tinker/proto/response_conv.py, as retrieve_future does).
Hostile bodies are built from a good one with our message classes, then broken one field at a time.
"""

import math
import random

import numpy as np
import pytest
from google.protobuf import descriptor_pb2
from hypothesis import given, settings
from hypothesis import strategies as st
from tinker.lib.chunked_fwdbwd_helpers import combine_fwd_bwd_output_results
from tinker.proto import tinker_public_pb2
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response
from tinker.types import (Datum, DmelChunk, EncodedTextChunk, ForwardBackwardInput, ImageChunk, ModelInput,
                          TensorData)
from tinker.types import ForwardBackwardRequest as SdkRequest
from tinker.types.provenance_spans import PromptProvenanceSpan, SampledProvenanceSpan

from shared import tinker_wire as wire
from shared.tinker_wire import Sequence, WireError, decode_forward_backward

LIMITS = {"max_datums": 8, "max_tokens": 256}


def sdk_body(data: list[Datum], loss_fn="cross_entropy", config=None, forward_only=False) -> bytes:
    """The body the SDK POSTs to /api/v1/forward_backward (tinker/resources/training.py)."""
    request = SdkRequest(forward_backward_input=ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config),
                         model_id="sess-1:train:0", seq_id=3)
    message = forward_backward_request_to_proto(request)
    message.forward_only = forward_only
    return message.SerializeToString()


def text_datum(tokens: list[int], **inputs) -> Datum:
    return Datum(model_input=ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


def csr(dense: np.ndarray, dtype: str) -> TensorData:
    """A 2-D array as the SDK's sparse CSR TensorData (what from_torch_sparse makes, without torch)."""
    rows, cols = np.nonzero(dense)
    crow = np.searchsorted(rows, np.arange(dense.shape[0] + 1))
    return TensorData(data=dense[rows, cols], dtype=dtype, shape=list(dense.shape),
                      sparse_crow_indices=crow.tolist(), sparse_col_indices=cols.tolist())


def test_schema_matches_the_sdks():
    """Every message, field and enum we define has the number, type, label and oneof of the
    SDK's own descriptor (what the bytes mean depends on nothing else)."""
    ours, theirs = wire._file_descriptor(), descriptor_pb2.FileDescriptorProto()
    tinker_public_pb2.DESCRIPTOR.CopyToProto(theirs)
    assert ours.package == theirs.package and ours.syntax == theirs.syntax
    assert list(ours.enum_type) == list(theirs.enum_type)

    def fields(message):
        def oneof(f):
            return message.oneof_decl[f.oneof_index].name if f.HasField("oneof_index") else None
        return {f.name: (f.number, f.label, f.type, f.type_name, f.proto3_optional, oneof(f)) for f in message.field}

    sdk_messages = {m.name: m for m in theirs.message_type}
    for message in ours.message_type:
        sdk = sdk_messages[message.name]
        assert fields(message).items() <= fields(sdk).items(), message.name
        sdk_nested = {n.name: n for n in sdk.nested_type}
        assert all(nested == sdk_nested[nested.name] for nested in message.nested_type), message.name
    assert len(wire.MESSAGES) == len(ours.message_type) > 15


def test_sdk_request_decodes_whole():
    n = 6
    rng = np.random.default_rng(0)
    top_k_tokens = np.where(rng.random((n, 3)) < 0.4, rng.integers(1, 1000, (n, 3)), 0).astype(np.int64)
    top_k_weights = (top_k_tokens > 0).astype(np.float32) * 0.5
    spans = PromptProvenanceSpan(sequence_id="seq-1", length=2), SampledProvenanceSpan(sequence_id="seq-2", length=4)
    data = [
        Datum(model_input=ModelInput(chunks=[EncodedTextChunk(tokens=[1, 2]), EncodedTextChunk(tokens=[3, 4, 5, 2**31 - 1])]),
              loss_fn_inputs={"target_tokens": np.arange(10, 16), "weights": [0, 0, 1, 1, 1, 1],
                              "advantages": np.full(6, -0.25, np.float32), "logprobs": TensorData(data=[-1.5] * 6, dtype="float32")}
              ).with_provenance(model_input=list(spans), loss_fn_inputs=list(spans)),
        text_datum([7] * n, target_tokens=csr(top_k_tokens, "int64"), weights=csr(top_k_weights, "float32")),
        text_datum([8] * 2, target_tokens=np.array([[5, 6], [7, 8]]), weights=np.array([[1.0, 0.5], [0.0, 2.0]])),
    ]
    call = decode_forward_backward(sdk_body(data, "ppo", {"clip_low_threshold": 0.8, "mode": "token"}, forward_only=True),
                                   **LIMITS)

    assert (call.model_id, call.seq_id, call.loss_fn, call.forward_only) == ("sess-1:train:0", 3, "ppo", True)
    assert call.config == {"clip_low_threshold": 0.8, "mode": "token"}
    assert [d.tokens.dtype for d in call.data] == [np.int32] * 3
    assert call.data[0].tokens.tolist() == [1, 2, 3, 4, 5, 2**31 - 1]
    first = call.data[0].inputs
    assert set(first) == {"target_tokens", "weights", "advantages", "logprobs"}
    assert first["target_tokens"].dtype == np.int64 and first["target_tokens"].tolist() == list(range(10, 16))
    assert first["weights"].dtype == np.float32 and first["weights"].tolist() == [0, 0, 1, 1, 1, 1]  # sent as int64
    assert first["advantages"].tolist() == [-0.25] * 6 and first["logprobs"].tolist() == [-1.5] * 6
    sparse = call.data[1].inputs
    assert sparse["target_tokens"].dtype == np.int64 and np.array_equal(sparse["target_tokens"], top_k_tokens)
    assert sparse["weights"].dtype == np.float32 and np.array_equal(sparse["weights"], top_k_weights)
    assert call.data[2].inputs["target_tokens"].tolist() == [[5, 6], [7, 8]]
    assert call.data[2].inputs["weights"].tolist() == [[1.0, 0.5], [0.0, 2.0]]


def test_legacy_config_is_read_under_v2():
    message = wire.ForwardBackwardRequest()
    message.ParseFromString(sdk_body([text_datum([1], weights=[1.0])]))
    message.loss_fn_config["kl_coeff"] = 0.5
    message.loss_fn_config["clip"] = 0.1
    message.loss_fn_config_v2["clip"].number = 0.2
    assert decode_forward_backward(message.SerializeToString(), **LIMITS).config == {"kl_coeff": 0.5, "clip": 0.2}


@st.composite
def datums(draw):
    """A datum as a training loop builds it: tokens in a few chunks, per-token inputs and
    sometimes (N, K) top-K inputs, dense or sparse."""
    n = draw(st.integers(1, 12))
    tokens = draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n))
    cuts = sorted(draw(st.lists(st.integers(1, n), max_size=3)))
    chunks = [EncodedTextChunk(tokens=tokens[a:b]) for a, b in zip([0, *cuts], [*cuts, n]) if b > a]
    floats = st.floats(-1e6, 1e6, width=32)
    inputs = {"target_tokens": np.array(draw(st.lists(st.integers(0, 2**40), min_size=n, max_size=n)), np.int64),
              "advantages": np.array(draw(st.lists(floats, min_size=n, max_size=n)), np.float32)}
    if draw(st.booleans()):
        k = draw(st.integers(1, 5))
        mask = np.array(draw(st.lists(st.booleans(), min_size=n * k, max_size=n * k))).reshape(n, k)
        top_k = np.where(mask, np.array(draw(st.lists(st.integers(1, 99), min_size=n * k, max_size=n * k))).reshape(n, k), 0)
        inputs["top_k"] = csr(top_k.astype(np.float32), "float32") if draw(st.booleans()) else top_k.astype(np.float32)
    return Datum(model_input=ModelInput(chunks=chunks), loss_fn_inputs=inputs), tokens, inputs


@settings(max_examples=60, deadline=None)
@given(st.lists(datums(), min_size=1, max_size=4))
def test_sdk_requests_round_trip(drawn):
    call = decode_forward_backward(sdk_body([d for d, _, _ in drawn]), max_datums=4, max_tokens=48)
    for datum, (_, tokens, inputs) in zip(call.data, drawn):
        assert datum.tokens.tolist() == tokens
        assert set(datum.inputs) == set(inputs)
        for name, sent in inputs.items():
            expected = sent if isinstance(sent, np.ndarray) else wire_dense(sent)
            assert datum.inputs[name].shape == expected.shape and np.array_equal(datum.inputs[name], expected), name


def wire_dense(td: TensorData) -> np.ndarray:
    """The SDK's CSR TensorData, dense, with 0 where nothing is listed (its default pad)."""
    dense = np.zeros(td.shape, np.float32)
    for row in range(td.shape[0]):
        lo, hi = td.sparse_crow_indices[row:row + 2]
        dense[row, td.sparse_col_indices[lo:hi]] = td._numpy[lo:hi]
    return dense


def good_message():
    message = wire.ForwardBackwardRequest()
    message.ParseFromString(sdk_body([
        text_datum([1, 2, 3], target_tokens=[2, 3, 4], weights=[1.0, 1.0, 1.0]),
        text_datum([5, 6], target_tokens=[6, 7], weights=csr(np.array([[0, 1.0], [0, 0]], np.float32), "float32")),
    ]))
    return message


def dense(message, name="weights", datum=0):
    return message.data[datum].loss_fn_inputs[name]


def sparse(message):
    return message.data[1].loss_fn_inputs["weights"]


def set_bytes(tensor, array, dtype):
    tensor.dense = np.asarray(array, dtype).tobytes()


def set_csr(message, values=None, crow=None, col=None):
    """Replace parts of the second datum's sparse weights (2 x 2, one value at row 0, column 1)."""
    parts = sparse(message).sparse_csr
    for name, array, dtype in (("values", values, "<f4"), ("crow_indices", crow, "<i8"), ("col_indices", col, "<i8")):
        if array is not None:
            setattr(parts, name, np.asarray(array, dtype).tobytes())


BROKEN = {  # what breaks the good message -> a fragment of the error
    "no datums": (lambda m: m.ClearField("data"), r"^data: no datums"),
    "too many datums": (lambda m: [m.data.add().CopyFrom(m.data[0]) for _ in range(7)], r"^data: 9 datums, more than the limit of 8"),
    "no tokens": (lambda m: m.data[1].ClearField("model_input"), r"^data\[1\]\.model_input: no tokens"),
    "an empty chunk": (lambda m: m.data[0].model_input.add(), r"^data\[0\]\.model_input\[1\]: an empty chunk"),
    "an image": (lambda m: m.data[0].model_input.add().image.SetInParent(), r"^data\[0\]\.model_input\[1\]: a image chunk; images"),
    "a dmel chunk": (lambda m: setattr(m.data[1].model_input[0].dmel, "dmel", b"x"), r"^data\[1\]\.model_input\[0\]: a dmel chunk"),
    "odd token bytes": (lambda m: setattr(m.data[0].model_input[0].encoded_text, "tokens", b"\x01\x00\x00\x00\x02"),
                        r"^data\[0\]\.model_input\[0\]\.tokens: 5 bytes, not a whole number of 4-byte"),
    "a negative token": (lambda m: setattr(m.data[1].model_input[0].encoded_text, "tokens", np.array([5, -6], "<i4").tobytes()),
                         r"^data\[1\]\.model_input: negative token ids"),
    "a negative target": (lambda m: set_bytes(dense(m, "target_tokens"), [2, -3, 4], "<i8"),
                          r"^data\[0\]\.loss_fn_inputs\['target_tokens'\]: negative token ids"),
    "float targets": (lambda m: dense(m, "target_tokens").CopyFrom(dense(m)),
                      r"^data\[0\]\.loss_fn_inputs\['target_tokens'\]: token ids must be int64"),
    "no dtype": (lambda m: dense(m).ClearField("dtype"), r"^data\[0\]\.loss_fn_inputs\['weights'\]: dtype 0 is not float32 or int64"),
    "bfloat16": (lambda m: setattr(dense(m), "dtype", 4), r"^data\[0\]\.loss_fn_inputs\['weights'\]: dtype 4 is not"),
    "an unknown dtype": (lambda m: setattr(dense(m), "dtype", 99), r"^data\[0\]\.loss_fn_inputs\['weights'\]: dtype 99 is not"),
    "bytes not whole values": (lambda m: setattr(dense(m), "dense", b"\x00" * 13),
                               r"^data\[0\]\.loss_fn_inputs\['weights'\]: 13 bytes, not a whole number of 4-byte"),
    "shape and bytes differ": (lambda m: dense(m).shape.append(2), r"\['weights'\]: shape \[3, 2\] holds 6 values, the bytes 3"),
    "a huge shape, few bytes": (lambda m: dense(m).shape.extend([2**40, 2**40]),
                                r"\['weights'\]: shape \[3, 1099511627776, 1099511627776\], more than 128 values per token"),
    "a huge first dimension": (lambda m: dense(m).shape.__setitem__(0, 2**62), r"\['weights'\]: shape \[4611686018427387904\], its first"),
    "a negative dimension": (lambda m: dense(m).shape.extend([-1]), r"\['weights'\]: shape \[3, -1\] has a negative dimension"),
    "a row per token": (lambda m: dense(m, "target_tokens", datum=1).shape.__setitem__(0, 3),
                        r"^data\[1\]\.loss_fn_inputs\['target_tokens'\]: shape \[3\], its first dimension is not the datum's 2 tokens"),
    "NaN": (lambda m: set_bytes(dense(m), [1, math.nan, 1], "<f4"), r"^data\[0\]\.loss_fn_inputs\['weights'\]: values that are not finite"),
    "infinity": (lambda m: set_bytes(dense(m), [1, 1, -math.inf], "<f4"), r"\['weights'\]: values that are not finite"),
    "a sparse NaN": (lambda m: set_csr(m, values=[math.nan]), r"^data\[1\]\.loss_fn_inputs\['weights'\]: values that are not finite"),
    "a sparse tensor without shape": (lambda m: sparse(m).ClearField("shape"),
                                      r"^data\[1\]\.loss_fn_inputs\['weights'\]: a sparse tensor without"),
    "a 3-D sparse tensor": (lambda m: sparse(m).shape.append(1),
                            r"^data\[1\]\.loss_fn_inputs\['weights'\]: a sparse CSR tensor of shape \[2, 2, 1\]"),
    "a column out of range": (lambda m: set_csr(m, col=[2]),
                              r"^data\[1\]\.loss_fn_inputs\['weights'\]\.col_indices: not 1 column indices in \[0, 2\)"),
    "a negative column": (lambda m: set_csr(m, col=[-1]), r"\['weights'\]\.col_indices: not 1 column"),
    "too few row pointers": (lambda m: set_csr(m, crow=[0, 1]),
                             r"^data\[1\]\.loss_fn_inputs\['weights'\]\.crow_indices: not 3 non-decreasing row pointers from 0 to 1"),
    "decreasing row pointers": (lambda m: set_csr(m, crow=[0, 2, 1]), r"\['weights'\]\.crow_indices: not 3 non-decreasing"),
    "row pointers past the values": (lambda m: set_csr(m, crow=[0, 1, 5]), r"\['weights'\]\.crow_indices: not 3"),
    "odd index bytes": (lambda m: setattr(sparse(m).sparse_csr, "col_indices", b"\x00" * 7),
                        r"^data\[1\]\.loss_fn_inputs\['weights'\]\.col_indices: 7 bytes, not a whole number of 8-byte"),
    "a repeated column": (lambda m: set_csr(m, values=[1, 2], crow=[0, 2, 2], col=[1, 1]),
                          r"\['weights'\]\.col_indices: columns not strictly increasing within a row"),
    "a NaN config": (lambda m: setattr(m.loss_fn_config_v2["clip"], "number", math.nan), r"^loss_fn_config\['clip'\]: nan is not a finite"),
    "an empty config value": (lambda m: m.loss_fn_config_v2["clip"].SetInParent(), r"^loss_fn_config_v2\['clip'\]: neither a number nor a text"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_hostile_requests_are_refused(case):
    message = good_message()
    assert decode_forward_backward(message.SerializeToString(), **LIMITS)  # good before the break
    breaking, error = BROKEN[case]
    breaking(message)
    with pytest.raises(WireError, match=error):
        decode_forward_backward(message.SerializeToString(), **LIMITS)


def test_token_limit_is_for_all_datums_together():
    body = sdk_body([text_datum(list(range(100)), weights=np.ones(100, np.float32)) for _ in range(3)])
    assert len(decode_forward_backward(body, max_datums=8, max_tokens=300).data) == 3
    with pytest.raises(WireError, match=r"^data\[2\]\.model_input: 300 tokens in data\[0\.\.2\], more than the limit of 299"):
        decode_forward_backward(body, max_datums=8, max_tokens=299)


def test_sdk_image_and_dmel_chunks_are_refused():
    for chunk in ImageChunk(data=b"\x89PNG", format="png", expected_tokens=4), DmelChunk(dmel=b"\x00" * 8):
        body = sdk_body([text_datum([1]), Datum(model_input=ModelInput(chunks=[EncodedTextChunk(tokens=[1]), chunk]))])
        with pytest.raises(WireError, match=rf"^data\[1\]\.model_input\[1\]: a {chunk.type} chunk; images and audio"):
            decode_forward_backward(body, **LIMITS)


def test_bodies_that_are_not_requests_are_refused():
    body = good_message().SerializeToString()
    whole = decode_forward_backward(body, **LIMITS)
    decoded = []
    for cut in range(1, len(body)):
        try:
            decoded.append(decode_forward_backward(body[:cut], **LIMITS))
        except WireError:
            pass
    # A cut between two top-level fields is a shorter request, as protobuf has it: here one
    # datum and no loss_fn (after the first datum), or no loss_fn (before it), which the worker refuses.
    assert [(len(call.data), call.loss_fn) for call in decoded] == [(1, ""), (2, "")] and whole.loss_fn
    noise = random.Random(0)
    for _ in range(200):
        with pytest.raises(WireError):
            decode_forward_backward(noise.randbytes(noise.randint(0, 300)), **LIMITS)
    with pytest.raises(WireError, match="^the body is not a ForwardBackwardRequest protobuf"):
        decode_forward_backward(b"\x1a\xff\xff\xff\xff\x0f", **LIMITS)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=400))
def test_any_bytes_decode_or_raise_wire_error(body):
    try:
        decode_forward_backward(body, **LIMITS)
    except WireError:
        pass


def test_forward_backward_output_reads_back_in_the_sdk():
    outputs = [{"logprobs": np.array([-0.5, -1.25, -2.0], np.float32), "top_k": np.arange(6).reshape(3, 2)},
               {"logprobs": np.array([-3.0]), "top_k": np.array([[7, 8]], np.int32)}]
    body = wire.encode_forward_backward_output(outputs, {"loss:sum": 2.5, "tokens:mean": 2.0})
    result = deserialize_forward_backward_output(body)

    assert result.loss_fn_output_type == "ArrayRecord" and result.metrics == {"loss:sum": 2.5, "tokens:mean": 2.0}
    assert len(result.loss_fn_outputs) == 2
    first, second = result.loss_fn_outputs
    assert (first["logprobs"].dtype, first["logprobs"].shape, first["logprobs"].tolist()) == ("float32", [3], [-0.5, -1.25, -2.0])
    assert (second["logprobs"].dtype, second["logprobs"].tolist()) == ("float32", [-3.0])  # float64 given
    assert (first["top_k"].dtype, first["top_k"].shape, first["top_k"].tolist()) == ("int64", [3, 2], [[0, 1], [2, 3], [4, 5]])
    assert (second["top_k"].dtype, second["top_k"].tolist()) == ("int64", [[7, 8]])
    # A forward_backward the SDK split in chunks: it merges the chunks' outputs by the metrics' reductions.
    merged = combine_fwd_bwd_output_results([result, deserialize_forward_backward_output(
        wire.encode_forward_backward_output(outputs[:1], {"loss:sum": 1.0, "tokens:mean": 5.0}))])
    assert merged.metrics == {"loss:sum": 3.5, "tokens:mean": 3.0} and len(merged.loss_fn_outputs) == 3

    empty = deserialize_forward_backward_output(wire.encode_forward_backward_output([], {"loss:sum": 0.0}))
    assert (empty.loss_fn_outputs, empty.metrics) == ([], {"loss:sum": 0.0})


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 10), st.integers(0, 3).map(float)), min_size=1, max_size=5), st.integers(1, 4))
def test_forward_backward_outputs_round_trip(sizes, k):
    outputs = [{"logprobs": np.full(n, -value, np.float32), "elementwise_loss": np.full(n, value, np.float32),
                "ids": np.full((n, k), n, np.int64)} for n, value in sizes]
    result = deserialize_forward_backward_output(wire.encode_forward_backward_output(outputs, {"loss:sum": 1.0}))
    for sent, got in zip(outputs, result.loss_fn_outputs, strict=True):
        for name, array in sent.items():
            assert got[name].shape == list(array.shape) and np.array_equal(got[name].to_numpy(), array)


@pytest.mark.parametrize("key", ["loss", "loss:sum:extra", "loss:median", ":"])
def test_metric_keys_must_be_name_colon_reduction(key):
    with pytest.raises(ValueError, match="name:reduction"):
        wire.encode_forward_backward_output([{"logprobs": np.zeros(1, np.float32)}], {key: 1.0})


@pytest.mark.parametrize("outputs", [
    [{"logprobs": np.zeros(2)}, {"loss": np.zeros(2)}],  # different names
    [{"logprobs": np.zeros(2)}, {"logprobs": np.zeros(2, np.int64)}],  # float and int
    [{"logprobs": np.zeros((2, 3))}, {"logprobs": np.zeros((2, 4))}],  # different trailing shapes
    [{"logprobs": np.float32(1.0)}],  # 0-d
    [{"mask": np.zeros(2, bool)}],  # neither float nor int
])
def test_bad_outputs_are_refused(outputs):
    with pytest.raises(ValueError):
        wire.encode_forward_backward_output(outputs, {"loss:sum": 0.0})


def test_sample_response_reads_back_in_the_sdk():
    sequences = [Sequence(tokens=[11, 12, 2**31 - 1], logprobs=[-0.1, -2.5, -0.0], stop_reason="stop"),
                 Sequence(tokens=[13], logprobs=[-7.75], stop_reason="length")]
    result = deserialize_sample_response(wire.encode_sample_response(sequences, prompt_logprobs=[None, -1.5, -0.25]))

    assert [s.tokens for s in result.sequences] == [[11, 12, 2**31 - 1], [13]]
    assert [s.stop_reason for s in result.sequences] == ["stop", "length"]
    assert result.sequences[0].logprobs == np.float32([-0.1, -2.5, -0.0]).tolist()
    assert result.sequences[1].logprobs == [-7.75]
    assert result.prompt_logprobs == [None, -1.5, -0.25]

    nan_first = deserialize_sample_response(wire.encode_sample_response(sequences[1:], [math.nan, -3.0]))
    assert nan_first.prompt_logprobs == [None, -3.0]
    assert deserialize_sample_response(wire.encode_sample_response(sequences)).prompt_logprobs is None
    with pytest.raises(ValueError, match="1 tokens but 2 logprobs"):
        wire.encode_sample_response([Sequence(tokens=[1], logprobs=[0.0, 0.0], stop_reason="stop")])

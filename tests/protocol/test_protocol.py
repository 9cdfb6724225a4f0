"""Wire protocol v1: round trips and malformed input, property-based."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from stoker.protocol import ALLOWED_DTYPES, PROTOCOL_VERSION, DecodeLimits, ProtocolError, decode_batch, encode_batch
from stoker.protocol.batch_codec import with_session
from stoker.protocol.batch_header import MAX_HEADER_BYTES
from stoker.protocol.peer_ids import is_valid_id, place_of, with_instance
from stoker.protocol.batch_spec import BOOKKEEPING, BatchSpec, bookkeeping_arrays

dtypes = st.sampled_from(sorted(ALLOWED_DTYPES)).map(np.dtype)
arrays = dtypes.flatmap(lambda dt: hnp.arrays(dt, hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5)))
names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,20}", fullmatch=True)


def _header(**overrides):
    header = {"v": PROTOCOL_VERSION, "producer": "p:1", "seq": 0, "worker": 0, "sent_at": 0.0,
              "arrays": [{"name": "x", "dtype": "uint8", "shape": [2, 3]}]}
    header.update(overrides)
    return msgpack.packb(header, use_bin_type=True)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(names, arrays, max_size=5), st.integers(0, 2**62))
def test_round_trip_preserves_every_array_exactly(batch, seq):
    frames = encode_batch(batch, producer="host:5555#0/1", seq=seq)
    decoded = decode_batch([bytes(memoryview(f)) for f in frames])
    assert decoded.header.seq == seq
    assert list(decoded.arrays) == list(batch)
    for name, array in batch.items():
        got = decoded[name]
        assert got.dtype == array.dtype.newbyteorder("<") and got.shape == array.shape
        np.testing.assert_array_equal(got, array)


def test_round_trip_over_real_zmq_socket_is_zero_copy():
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    try:
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push.connect(f"tcp://127.0.0.1:{port}")
        images = np.random.default_rng(0).integers(0, 255, (8, 32, 32, 3), dtype=np.uint8)
        push.send_multipart(encode_batch({"images": images}, producer="p", seq=1), copy=False)
        assert pull.poll(5000)
        frames = pull.recv_multipart(copy=False)
        batch = decode_batch(frames)
        np.testing.assert_array_equal(batch["images"], images)
        # The array views the received frame's memory: no copy was made.
        assert np.shares_memory(batch["images"], np.frombuffer(frames[1].buffer, np.uint8))
    finally:
        push.close(0)
        pull.close(0)
        ctx.term()


def test_big_endian_and_non_contiguous_arrays_are_sent_little_endian():
    a = np.arange(12, dtype=">i4").reshape(3, 4)[:, ::2]
    decoded = decode_batch(encode_batch({"a": a}, producer="p", seq=0))
    np.testing.assert_array_equal(decoded["a"], a)


def test_encoding_refuses_object_arrays_so_nothing_could_need_pickle():
    with pytest.raises(ProtocolError, match="dtype object"):
        encode_batch({"a": np.array([{}], dtype=object)}, producer="p", seq=0)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=200), min_size=0, max_size=4))
def test_random_frames_raise_protocol_error_and_nothing_else(frames):
    try:
        decode_batch(frames)
    except ProtocolError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(max_size=8), st.one_of(st.integers(-(2**63), 2**64 - 1), st.text(max_size=8), st.none(),
                                                       st.lists(st.integers(0, 9), max_size=3)), max_size=6))
def test_random_msgpack_headers_raise_protocol_error(header):
    with pytest.raises(ProtocolError):
        decode_batch([msgpack.packb(header), b"\x00" * 6])


@pytest.mark.parametrize(
    "header, frames, message",
    [
        (_header(v=2), [b"\x00" * 6], "protocol version 2 is not supported"),
        (_header(v="1"), [b"\x00" * 6], "protocol version"),
        (_header(arrays=[{"name": "x", "dtype": "object", "shape": [2, 3]}]), [b"\x00" * 6], "dtype 'object'"),
        (_header(arrays=[{"name": "x", "dtype": ">f8", "shape": [2, 3]}]), [b"\x00" * 6], "dtype '>f8'"),
        (_header(arrays=[{"name": "x", "dtype": "uint8", "shape": [-2, -3]}]), [b"\x00" * 6], "integers >= 0"),
        (_header(arrays=[{"name": "x", "dtype": "uint8", "shape": [2, 4]}]), [b"\x00" * 6], "frame has 6"),
        (_header(arrays=[{"name": "x", "dtype": "uint8", "shape": [2**40, 2**40]}]), [b"\x00" * 6], "frame has 6"),
        (_header(arrays=[{"name": "x", "dtype": "uint8", "shape": [1] * 9}]), [b"\x00"], "at most 8 dims"),
        (_header(), [], "has 0 data frames"),
        (_header(), [b"\x00" * 6, b"extra"], "has 2 data frames"),
        (_header(seq=-1), [b"\x00" * 6], "'seq'"),
        (_header(producer="a b"), [b"\x00" * 6], "'producer'"),
        (_header(producer="p\n"), [b"\x00" * 6], "'producer'"),
        (_header(arrays=[{"name": "x", "dtype": "uint8", "shape": [2, 3]}] * 2), [b"\x00" * 6] * 2, "appears twice"),
        (_header(stages={"decode": -1.0}), [b"\x00" * 6], "'stages'"),
        (_header(stages={"decode": "fast"}), [b"\x00" * 6], "'stages'"),
        (_header(stages={"parse": 1.0}), [b"\x00" * 6], "'stages'"),
        (_header(stages={"send": float("nan")}), [b"\x00" * 6], "'stages'"),
        (_header(classes=-1), [b"\x00" * 6], "'classes'"),
        (_header(classes=True), [b"\x00" * 6], "'classes'"),
        (_header(classes=10**7 + 1), [b"\x00" * 6], "'classes'"),
        (_header(classes="4"), [b"\x00" * 6], "'classes'"),
        (_header(source="x" * 257), [b"\x00" * 6], "'source'"),
        (_header(source=7), [b"\x00" * 6], "'source'"),
        (_header(source=b"tar x"), [b"\x00" * 6], "'source'"),
        (_header(source="tar /d\n"), [b"\x00" * 6], "'source'"),
        (_header(source="tar /d\x7f"), [b"\x00" * 6], "'source'"),
        (_header(source="tar /d\u00e9"), [b"\x00" * 6], "'source'"),
        (msgpack.packb([1, 2, 3]), [], "must be a msgpack map"),
        (b"\xc1garbage", [], "not valid msgpack"),
        (b"\x00" * (64 * 1024 + 1), [], "header frame is"),
    ],
)
def test_malformed_messages_name_what_is_wrong(header, frames, message):
    with pytest.raises(ProtocolError, match=message):
        decode_batch([header, *frames])


def test_stage_times_travel_in_the_header():
    frames = encode_batch({"x": np.zeros(4, np.uint8)}, producer="p", seq=0,
                          stages={"read": 0.5, "decode": 1.25, "augment": 0.0, "send": 2})
    assert decode_batch(frames).header.stages == {"read": 0.5, "decode": 1.25, "augment": 0.0, "send": 2.0}
    assert decode_batch(encode_batch({"x": np.zeros(4, np.uint8)}, producer="p", seq=0)).header.stages == {}
    with pytest.raises(ProtocolError, match="'stages'"):  # a sender never emits what a receiver refuses
        encode_batch({"x": np.zeros(4, np.uint8)}, producer="p", seq=0, stages={"decode": -0.5})


def test_the_dataset_class_count_travels_in_the_header():
    frames = encode_batch({"x": np.zeros(4, np.uint8)}, producer="p", seq=0, classes=4)
    assert decode_batch(frames).header.classes == 4
    assert decode_batch(encode_batch({"x": np.zeros(4, np.uint8)}, producer="p", seq=0)).header.classes == 0
    with pytest.raises(ProtocolError, match="classes"):  # a sender never emits what a receiver refuses
        encode_batch({"x": np.zeros(4, np.uint8)}, producer="p", seq=0, classes=-2)


def test_the_dataset_served_travels_in_the_header_and_an_older_receiver_ignores_it():
    source = "tar s3://b/laion/" + "~" * 200 + "/index.json"  # 227 characters: printable ASCII, spaces too
    frames = encode_batch({"x": np.zeros(4, np.uint8)}, producer="p", seq=0, source=source)
    assert decode_batch(frames).header.source == source
    assert decode_batch(encode_batch({"x": np.zeros(4, np.uint8)}, producer="p", seq=0)).header.source == ""
    body = msgpack.unpackb(frames[0], raw=False)
    assert body["source"] == source  # a new key beside the others: receivers ignore keys they do not know
    assert decode_batch([_header(future_field="x" * 300), b"\x00" * 6]).header.source == ""
    for bad in ("x" * 257, "tar /d\t", "tar /d\u00e9", 3):  # a sender never emits what a receiver refuses
        with pytest.raises(ProtocolError, match="'source'"):
            encode_batch({"x": np.zeros(4, np.uint8)}, producer="p", seq=0, source=bad)


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.text(max_size=300), st.binary(max_size=8), st.integers(-(2**63), 2**64 - 1), st.none()))
def test_a_source_is_accepted_exactly_when_a_receiver_would_and_survives_a_session_rewrite(source):
    header = {"v": PROTOCOL_VERSION, "producer": "p", "seq": 0, "arrays": [], "source": source}
    valid = isinstance(source, str) and len(source) <= 256 and all(" " <= c <= "~" for c in source)
    try:
        decoded = decode_batch([msgpack.packb(header, use_bin_type=True)]).header
    except ProtocolError as exc:
        assert not valid and "'source'" in str(exc)
        return
    assert valid and decoded.source == source
    rewritten = with_session(encode_batch({}, producer="p", seq=0, source=source)[0], stream="0/1:4:0", session=1)
    assert len(rewritten) <= MAX_HEADER_BYTES and decode_batch([rewritten]).header.source == source


def test_message_size_limit_is_enforced_before_decoding():
    frames = encode_batch({"x": np.zeros(1000, np.uint8)}, producer="p", seq=0)
    with pytest.raises(ProtocolError, match="more than the 500 allowed"):
        decode_batch(frames, DecodeLimits(max_message_bytes=500))


def test_default_producer_ids_differ_per_instance_fit_the_header_and_keep_their_place():
    ids = {with_instance("vm:5555#auto") for _ in range(20)}
    assert len(ids) == 20 and all(is_valid_id(i) and place_of(i) == "vm:5555#auto" for i in ids)
    long = with_instance("h" * 200)
    assert len(long) == 128 and is_valid_id(long)
    assert decode_batch(encode_batch({"a": np.zeros(1)}, producer=long, seq=0)).header.producer == long
    assert place_of("data0#0/2") == "data0#0/2"  # an --id without the suffix is its own place


def _worker_header(**extra):
    arrays = {"images": np.zeros((2, 4, 4, 3), np.uint8), "index": np.arange(2), "epoch": np.zeros(2, np.int32),
              "mask": np.ones(2, bool)}
    return encode_batch(arrays, producer="host:5555#0/2~abcdef", seq=7, worker=1,
                        stages={"read": 0.25, "decode": 0.5, "augment": 0.125, "send": 0.0}, **extra)[0]


@pytest.mark.parametrize("stream", ["0/2:41:5", ""])
def test_setting_stream_and_session_writes_the_bytes_a_raw_msgpack_rewrite_did(stream):
    # The exact forwarder rewrote worker headers with raw msgpack; the codec's function must send the same bytes.
    header = _worker_header(stream=stream)
    body = msgpack.unpackb(header, raw=False)
    body["stream"], body["session"] = "splits:103:7", 12
    assert with_session(header, stream="splits:103:7", session=12) == msgpack.packb(body, use_bin_type=True)
    decoded = decode_batch([with_session(header, stream="splits:103:7", session=12), b"\x00" * 96,
                            b"\x00" * 16, b"\x00" * 8, b"\x00" * 2]).header
    assert (decoded.stream, decoded.session, decoded.seq, decoded.producer) == ("splits:103:7", 12, 7,
                                                                                "host:5555#0/2~abcdef")


def _just_under_the_limit():
    """A valid header frame 8 bytes under MAX_HEADER_BYTES: naming a stream and session takes it over."""
    fill = {f"k{i}": "z" * 4000 for i in range(16)}
    size = len(_header(**fill, pad=""))
    frame = _header(**fill, pad="y" * (MAX_HEADER_BYTES - 8 - size - 2))  # str 8 -> str 16 costs 2 bytes
    assert len(frame) == MAX_HEADER_BYTES - 8
    return frame


@pytest.mark.parametrize("frame, stream, session, message", [
    (_header(), "x" * 65, 1, "at most 64 characters"),
    (_header(), 1, 1, "at most 64 characters"),
    (_header(), "0/1:10:0", -2, "session must be an integer"),
    (_header(), "0/1:10:0", 2**31, "session must be an integer"),
    (_header(), "0/1:10:0", True, "session must be an integer"),
    (msgpack.packb([1, 2]), "0/1:10:0", 1, "must be a msgpack map"),
    (b"\xc1", "0/1:10:0", 1, "not valid msgpack"),
    (b"\x00" * (MAX_HEADER_BYTES + 1), "0/1:10:0", 1, "header frame is"),
    (_just_under_the_limit(), "0/1:10:0", 1, "more than the 65536 allowed"),
])
def test_setting_stream_and_session_refuses_what_a_receiver_would(frame, stream, session, message):
    with pytest.raises(ProtocolError, match=message):
        with_session(frame, stream=stream, session=session)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.text(max_size=70), st.integers(-3, 2**32))
def test_setting_stream_and_session_on_random_frames_refuses_or_yields_a_header_a_receiver_reads(frame, stream,
                                                                                                   session):
    try:
        out = with_session(frame, stream=stream, session=session)
    except ProtocolError:
        return
    body = msgpack.unpackb(out, raw=False)
    assert body["stream"] == stream and body["session"] == session and len(out) <= MAX_HEADER_BYTES


def test_the_bookkeeping_arrays_are_one_definition_for_producers_and_trainers():
    assert bookkeeping_arrays(exact=False) == (("index", "int64"), ("epoch", "int32"))
    assert bookkeeping_arrays(exact=True) == (("index", "int64"), ("epoch", "int32"), ("mask", "bool"))
    assert BOOKKEEPING == ("index", "epoch", "mask")
    spec = BatchSpec.classification(8, (4, 4, 3))
    assert [(a.name, a.dtype, a.shape) for a in spec.arrays[2:]] == [("index", "int64", (8,)), ("epoch", "int32", (8,))]


# ---- exact mode's control messages (docs/protocol.md, "Exact mode") ---------------------------------------------

def test_a_goodbye_round_trips_and_a_status_says_whether_its_producer_takes_one():
    from stoker.protocol.exact_messages import (Goodbye, Status, decode_status, decode_trainer_message,
                                                encode_goodbye, encode_status)

    assert decode_trainer_message(encode_goodbye(Goodbye(7))) == Goodbye(7)
    announcing = Status("0/1:10:0", "p", 0, None, False, session=7, goodbye=True)
    assert decode_status(msgpack.unpackb(encode_status(announcing))).goodbye is True
    # A producer of an older release sends no such field: it takes no goodbye, and a trainer sends it none.
    older = {"t": "status", "stream": "0/1:10:0", "producer": "p", "completed": 0, "epochs": None, "finished": False}
    assert decode_status(older).goodbye is False


@pytest.mark.parametrize("body, message", [
    ({"t": "goodbye"}, "goodbye 'session'"),
    ({"t": "goodbye", "session": -1}, "goodbye 'session'"),
    ({"t": "goodbye", "session": True}, "goodbye 'session'"),
    ({"t": "goodbye", "session": "1"}, "goodbye 'session'"),
    ({"t": "goodbye", "session": 2**31}, "goodbye 'session'"),
    ({"t": "farewell", "session": 1}, "unknown control message type 'farewell'"),
])
def test_malformed_goodbyes_and_unknown_types_name_what_is_wrong(body, message):
    from stoker.protocol.exact_messages import decode_trainer_message

    with pytest.raises(ProtocolError, match=message):
        decode_trainer_message(msgpack.packb(body))


def test_a_status_whose_goodbye_is_not_true_or_false_is_refused():
    from stoker.protocol.exact_messages import decode_status

    body = {"t": "status", "stream": "0/1:10:0", "producer": "p", "completed": 0, "epochs": None, "finished": False,
            "goodbye": "yes"}
    with pytest.raises(ProtocolError, match="'goodbye'"):
        decode_status(body)


_control_values = st.one_of(st.integers(-(2**63), 2**64 - 1), st.booleans(), st.none(), st.text(max_size=8),
                            st.binary(max_size=8), st.lists(st.integers(-2, 2**31), max_size=3),
                            st.dictionaries(st.text(max_size=4), st.integers(-(2**63), 2**64 - 1), max_size=2))


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(["hello", "credit", "work", "describe", "goodbye", "other", None]),
       st.dictionaries(st.sampled_from(["v", "session", "trainer", "credit", "state", "held", "n", "consumed",
                                        "items", "finished"]), _control_values, max_size=6))
def test_random_trainer_messages_decode_or_raise_protocol_error_and_nothing_else(kind, fields):
    """What a producer reads from any peer: a message of a known type, whole and checked, or a ProtocolError."""
    from stoker.protocol.exact_messages import Credit, Describe, Goodbye, Hello, Work, decode_trainer_message

    body = {**fields, "t": kind} if kind is not None else fields
    try:
        message = decode_trainer_message(msgpack.packb(body, use_bin_type=True))
    except ProtocolError:
        return
    assert isinstance(message, (Hello, Credit, Work, Describe, Goodbye))
    if isinstance(message, Goodbye):
        assert type(message.session) is int and 0 <= message.session < 2**31


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_random_bytes_as_a_trainer_message_raise_protocol_error_and_nothing_else(frame):
    from stoker.protocol.exact_messages import decode_trainer_message

    try:
        decode_trainer_message(frame)
    except ProtocolError:
        pass

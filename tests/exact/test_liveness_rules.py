"""Adaptive liveness (issue 41, docs/protocol.md "Liveness"): how far apart heartbeats and statuses that say nothing
new go, and that peers of an older release, which send neither new field, get the old figures."""

import msgpack
import pytest
from hypothesis import given, settings, strategies as st

from stoker.protocol import ProtocolError
from stoker.protocol.exact_messages import (Hello, Status, decode_status, decode_trainer_message, encode_hello,
                                            encode_status)
from stoker.protocol.input_state import InputState

from stoker.consumer.exact.attention import (HEARTBEAT_S, MAX_HEARTBEAT_S, MAX_STATUS_S, heartbeat_every,
                                             status_every)
from stoker.consumer.exact.known_producer import KnownProducer


def _status(**kw) -> Status:
    return Status("0/4:100:0", "p0", 0, None, False, **kw)


def test_an_older_producer_is_heartbeaten_as_before_and_a_newer_by_its_trainer_timeout():
    p = KnownProducer("tcp://127.0.0.1:1", None, 0.0)  # type: ignore[arg-type]
    assert p.heartbeat_s == HEARTBEAT_S  # no status yet
    old = {k: v for k, v in msgpack.unpackb(encode_status(_status())).items() if k != "trainer_timeout"}
    p.status = decode_status(old)
    assert p.status.trainer_timeout is None and p.heartbeat_s == HEARTBEAT_S
    p.status = decode_status(msgpack.unpackb(encode_status(_status(trainer_timeout=10.0))))
    assert p.status.trainer_timeout == 10.0 and p.heartbeat_s == 1.25  # eight a timeout


@settings(max_examples=80, deadline=None)
@given(st.floats(0.001, 86400.0))
def test_a_heartbeat_goes_at_least_eight_times_a_trainer_timeout_or_as_often_as_before(timeout):
    every = heartbeat_every(timeout)
    assert HEARTBEAT_S <= every <= MAX_HEARTBEAT_S
    assert every <= timeout / 8 or every == HEARTBEAT_S  # never rarer than eight a timeout, unless the old rate


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 100_000), st.one_of(st.none(), st.floats(0.01, 3600.0)))
def test_statuses_are_asked_for_every_second_in_a_small_job_and_never_staler_than_a_quarter_stall_bound(n, stall):
    every = status_every(n, stall)
    assert 1.0 <= every <= MAX_STATUS_S
    if n <= 64:
        assert every == 1.0  # a small job: as before
    if stall is not None:
        assert every <= max(1.0, stall / 4)  # an idle producer's status excuses it from the stall check
    assert status_every(n + 1, stall) >= every  # growing with the fan-in


def test_a_hello_asks_for_a_period_an_older_producer_ignores_and_an_older_trainer_gets_every_second():
    hello = Hello("trainer-1", 3, 4, InputState(), {}, status_s=2.5)
    assert decode_trainer_message(encode_hello(hello)).status_s == 2.5
    body = msgpack.unpackb(encode_hello(hello))
    del body["status_s"]  # an older trainer's hello
    assert decode_trainer_message(msgpack.packb(body)).status_s == 1.0


@pytest.mark.parametrize("bad", [0.5, 31.0, "2", True, None])
def test_a_hello_asking_for_statuses_out_of_bounds_is_refused_naming_the_field(bad):
    body = msgpack.unpackb(encode_hello(Hello("trainer-1", 3, 4, InputState(), {})))
    body["status_s"] = bad
    with pytest.raises(ProtocolError, match="status_s"):
        decode_trainer_message(msgpack.packb(body))


@pytest.mark.parametrize("bad", [0, -1.0, 1e9, "10", False])
def test_a_status_with_a_trainer_timeout_out_of_bounds_is_refused_naming_the_field(bad):
    body = msgpack.unpackb(encode_status(_status(trainer_timeout=10.0)))
    body["trainer_timeout"] = bad
    with pytest.raises(ProtocolError, match="trainer_timeout"):
        decode_status(body)

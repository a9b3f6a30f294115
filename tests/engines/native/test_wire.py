"""The engine process's messages: loraplex's types come back equal, foreign ones are refused."""

import dataclasses
from pathlib import Path

import msgpack
import pytest

from loraplex.artifacts import Pieces
from loraplex.engines.native import wire
from loraplex.engines.native.errors import InvalidRequest
from loraplex.engines.native.sequence import RequestOutput, SamplingParams, StructuredOutput
from loraplex.residency.budgets import Budget, TenantBudgets
from loraplex.residency.errors import AdapterUnavailable, CapacityExceeded
from loraplex.residency.key import AdapterKey, AdapterRef


def roundtrip(obj):
    return wire.decode(wire.encode(obj))


def test_requests_and_outputs_come_back_equal():
    key = AdapterKey("sha256:b", "name", "r1", "sha256:d")
    ref = AdapterRef(key, Path("/a/b"), tenant="alice", priority=3)
    params = SamplingParams(
        stop=("x",), logit_bias=((1, 2.0),), structured=StructuredOutput(json_object=True)
    )
    out = RequestOutput("id", [1, 2], "ab", [], True, "stop", 3, 2, cache_tier="gpu")
    back = roundtrip([ref, params, out, {key: ["gpu", None, False, True]}, {key}])
    assert back[:3] == [ref, params, out]
    assert hash(back[0].key) == hash(key) and back[3] == {key: ["gpu", None, False, True]}
    assert back[4] == {key} and isinstance(back[1].stop, tuple)


def test_exceptions_keep_their_class_message_and_fields():
    errors = roundtrip(
        [
            AdapterUnavailable("at /store/x", "public"),
            InvalidRequest("n", "bad"),
            CapacityExceeded(),
        ]
    )
    assert type(errors[0]) is AdapterUnavailable and errors[0].public == "public"
    assert str(errors[0]) == "at /store/x"
    assert type(errors[1]) is InvalidRequest and errors[1].param == "n"
    assert type(errors[2]) is CapacityExceeded


def test_foreign_types_are_refused():
    with pytest.raises(TypeError):
        wire.encode(object())
    # a dataclass named from outside loraplex is not built on decoding
    foreign = msgpack.ExtType(1, wire.encode(["subprocess", "Popen", {"args": ["true"]}]))
    with pytest.raises(TypeError):
        wire.decode(msgpack.packb(foreign))
    # an exception of another package arrives as a RuntimeError with its text
    other = msgpack.ExtType(7, wire.encode(["json.decoder", "JSONDecodeError", ["boom"], {}]))
    error = wire.decode(msgpack.packb(other))
    assert type(error) is RuntimeError and str(error) == "boom"


def test_repeated_values_decode_to_one_object_and_outputs_travel_as_rows():
    key = AdapterKey("sha256:b", "name", "r1", "sha256:d")
    first = wire.encode([AdapterRef(key, Path("/a"), tenant="alice"), SamplingParams(n=2)])
    again = wire.encode([AdapterRef(key, Path("/a"), tenant="alice"), SamplingParams(n=2)])
    assert first == again
    (ref, params), (ref2, params2) = wire.decode(first), wire.decode(again)
    assert ref is ref2 and params is params2 and params.n == 2 and ref.key == key
    # a field left out of comparisons still tells two values apart
    other = AdapterRef(key, Path("/a"), tenant="alice", pieces=None)
    pieces = Pieces(4, (("a", 4, ("h",)),))
    with_pieces = wire.decode(wire.encode(dataclasses.replace(other, pieces=pieces)))
    assert with_pieces.pieces == pieces and wire.decode(wire.encode(other)).pieces is None
    # a frozen value holding a list is not hashable: sent whole each time, equal on arrival
    budgets = TenantBudgets(2, 100, tenants={"a": Budget(1, None)})
    assert roundtrip(budgets) == budgets
    outputs = [
        RequestOutput("a", [1], "x", [], False, None, 3, 1),
        RequestOutput("b", [], "", [], True, "stop", 3, 1, InvalidRequest("n", "bad")),
    ]
    back = wire.from_rows(RequestOutput, roundtrip(wire.rows(outputs)))
    assert back[0] == outputs[0] and back[1].finish_reason == "stop"
    assert type(back[1].error) is InvalidRequest and back[1].error.param == "n"

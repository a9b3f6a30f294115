"""The engine process's messages: loraplex's types come back equal, foreign ones are refused."""

from pathlib import Path

import msgpack
import pytest

from loraplex.cache.errors import AdapterUnavailable, CapacityExceeded
from loraplex.cache.key import AdapterKey, AdapterRef
from loraplex.engine import wire
from loraplex.engine.errors import InvalidRequest
from loraplex.engine.sequence import RequestOutput, SamplingParams, StructuredOutput


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

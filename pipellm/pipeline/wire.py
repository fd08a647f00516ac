"""How messages cross a socket: data only, authenticated, validated on arrival. No pickle.

A payload is a JSON header plus raw array buffers:

    u32 header length | header: {"kind": message class, "value": fields, "arrays": [[dtype, shape], ...]} | buffers

A dataclass goes as the list of its fields in order. They are decoded by the message dataclasses' own type
annotations (nested dataclasses, lists, tuples, arrays by index into "arrays"), and the dataclass is built with its
constructor, so its own checks run too. Only the classes in KINDS are ever built. A frame is the payload plus an
HMAC-SHA256 tag over a context (who sends to whom, which message in order) and the payload, keyed by the run's shared
token: a peer without the token can neither forge nor replay a message.
"""
import dataclasses
import hashlib
import hmac
import json
import math
import operator
import os
import secrets
import struct
import types
import typing

import numpy as np

from pipellm.config import EngineConfig, SpeculativeConfig
from pipellm.model_config import ModelConfig
from pipellm.pipeline.messages import (BlockTableChanges, Inspect, LoRALoad, NewRequest, ProbeReport, SampledBatch,
                                       Shutdown, StageArgs, StageBatch, StageReport)
from pipellm.pipeline.partition import StageLayers
from pipellm.rope_config import RopeConfig
from pipellm.sampler import PromptLogprobs, SampledToken
from pipellm.sampling_params import SamplingParams, StructuredOutputsParams

KINDS = {cls.__name__: cls for cls in (StageArgs, StageBatch, SampledBatch, ProbeReport, Inspect, Shutdown,
                                             StageReport)}
_NESTED = (BlockTableChanges, LoRALoad, NewRequest, SampledToken, PromptLogprobs, SamplingParams,
           StructuredOutputsParams, StageLayers, ModelConfig, RopeConfig, EngineConfig,
           SpeculativeConfig)  # only inside a kind
DTYPES = {np.dtype(t).str: np.dtype(t) for t in (np.int64, np.int32, np.float32, np.float64, np.uint8, np.bool_)}
MAX_PAYLOAD_BYTES = 256 << 20   # a trace report of 200,000 events is ~15 MB
TAG_BYTES = 32                  # HMAC-SHA256
MIN_TOKEN_CHARS = 16
TOKEN_ENV = "PIPELLM_TOKEN"


class WireError(ValueError):
    """A frame that is forged, malformed, or not a message the receiver expects."""


# ---- the shared secret ----------------------------------------------------------------------------------------

def new_token() -> str:
    return secrets.token_hex(32)


def check_token(token: str, source: str) -> bytes:
    token = token.strip()
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"{source}: the token has {len(token)} characters; use at least {MIN_TOKEN_CHARS} "
                         f"random ones, e.g. python -c 'import secrets; print(secrets.token_hex(32))'")
    return token.encode()


def read_token_file(path: str) -> bytes:
    try:
        with open(path) as f:
            return check_token(f.read(), path)
    except OSError as e:
        raise ValueError(f"--token-file {path}: cannot read it ({e.strerror}); copy the driver's token file "
                         "to this host") from None


def write_token_file(path: str) -> bytes:
    """A new token in a file only its owner can read (the other hosts need a copy)."""
    token = new_token()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        raise ValueError(f"--token-file {path}: cannot create it ({e.strerror}); give a path in a folder you can "
                         "write to") from None
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token.encode()


def token_from_env_or_file(token_file: str | None) -> bytes | None:
    """The token a process was given: PIPELLM_TOKEN, else --token-file; None when neither."""
    if os.environ.get(TOKEN_ENV):
        return check_token(os.environ[TOKEN_ENV], TOKEN_ENV)
    return None if token_file is None else read_token_file(token_file)


# ---- frames ---------------------------------------------------------------------------------------------------

def _tag(key: bytes, context: bytes, payload) -> bytes:
    mac = hmac.new(key, struct.pack("<I", len(context)) + context, hashlib.sha256)
    mac.update(payload)
    return mac.digest()


def seal(key: bytes, context: bytes, payload: bytes) -> bytes:
    return payload + _tag(key, context, payload)


def unseal(key: bytes, context: bytes, frame, sender: str) -> memoryview:
    """The payload of a frame whose tag is right; WireError naming the sender otherwise."""
    frame = memoryview(frame)
    payload, tag = frame[:-TAG_BYTES], frame[-TAG_BYTES:]
    if len(frame) < TAG_BYTES or not hmac.compare_digest(_tag(key, context, payload), tag):
        raise WireError(f"a frame from {sender} is not signed with this run's token (a peer with another token, "
                        "or someone else, sent it, or it was replayed or damaged)")
    return payload


# ---- encoding -------------------------------------------------------------------------------------------------

_PLAIN = {str, int, float, bool, type(None)}
_GETTERS: dict[type, operator.attrgetter] = {}
_JSON = json.JSONEncoder(separators=(",", ":"))  # made once: json.dumps with options makes one per call


def _to_json(value, arrays: list):
    kind = type(value)
    if kind in _PLAIN:
        return value
    if kind is list or kind is tuple:
        return value if all(type(v) in _PLAIN for v in value) else [_to_json(v, arrays) for v in value]
    if kind is dict:  # a list of [key, value] pairs (JSON keys would be strings)
        return [[_to_json(k, arrays), _to_json(v, arrays)] for k, v in value.items()]
    if kind is np.ndarray:
        arrays.append(np.ascontiguousarray(value))
        return len(arrays) - 1
    getter = _GETTERS.get(kind)
    if getter is None and dataclasses.is_dataclass(value):
        names = _field_names(kind)
        getter = _GETTERS[kind] = operator.attrgetter(*names) if len(names) > 1 else (
            lambda v: tuple(getattr(v, n) for n in names))
    if getter is not None:  # positional: the list of its fields in order
        values = getter(value)
        return values if all(type(v) in _PLAIN for v in values) else [_to_json(v, arrays) for v in values]
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"cannot put a {kind.__name__} on the wire")


def encode(msg) -> bytes:
    assert type(msg).__name__ in KINDS, f"{type(msg).__name__} is not a message"
    arrays: list[np.ndarray] = []
    value = _to_json(msg, arrays)
    header = _JSON.encode({"kind": type(msg).__name__, "value": value,
                           "arrays": [[a.dtype.str, a.shape] for a in arrays]}).encode()
    return b"".join([struct.pack("<I", len(header)), header, *(a.tobytes() for a in arrays)])


# ---- decoding: each field checked against its annotation --------------------------------------------------------

def _field_names(cls) -> tuple[str, ...]:
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = tuple(f.name for f in dataclasses.fields(cls) if f.init)
    return names


_FIELDS: dict[type, tuple[str, ...]] = {}
_CONVERTERS: dict[object, typing.Callable] = {}


def _fail(what: str):
    raise WireError(what)


def _scalar(value, arrays):
    if value is None or type(value) in (bool, int, float, str):
        return value
    _fail(f"expected a number, string or null, got {type(value).__name__}")


def _converter(tp) -> typing.Callable:
    """A function (json value, arrays) -> value of type tp, raising WireError on anything else."""
    conv = _CONVERTERS.get(tp)
    if conv is None:
        conv = _CONVERTERS[tp] = _make_converter(tp)
    return conv


def _make_converter(tp) -> typing.Callable:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is int:
        return lambda v, a: v if type(v) is int else _fail(f"expected an integer, got {type(v).__name__}")
    if tp is float:
        return lambda v, a: float(v) if type(v) in (float, int) else _fail(f"expected a number, got {type(v).__name__}")
    if tp is str:
        return lambda v, a: v if type(v) is str else _fail(f"expected a string, got {type(v).__name__}")
    if tp is bool:
        return lambda v, a: v if type(v) is bool else _fail(f"expected true/false, got {type(v).__name__}")
    if tp is type(None):
        return lambda v, a: None if v is None else _fail(f"expected null, got {type(v).__name__}")
    if tp is np.ndarray:
        def array(v, arrays):
            if type(v) is not int or not 0 <= v < len(arrays):
                _fail(f"expected an array index below {len(arrays)}, got {v!r}")
            return arrays[v]
        return array
    if tp is tuple or tp is list:  # untyped items (trace events): plain scalars only
        def items(v, arrays):
            if type(v) is not list:
                _fail(f"expected a list, got {type(v).__name__}")
            return tp(_scalar(x, arrays) for x in v)
        return items
    if origin is list or (origin is tuple and len(args) == 2 and args[1] is Ellipsis):
        item, make = _converter(args[0]), origin

        def seq(v, arrays):
            if type(v) is not list:
                _fail(f"expected a list, got {type(v).__name__}")
            return make([item(x, arrays) for x in v])
        return seq
    if origin is dict:
        key, val = _converter(args[0]), _converter(args[1])

        def pairs(v, arrays):
            if type(v) is not list or any(type(kv) is not list or len(kv) != 2 for kv in v):
                _fail("expected a list of [key, value] pairs")
            return {key(k, arrays): val(x, arrays) for k, x in v}
        return pairs
    if origin is tuple:
        convs = [_converter(t) for t in args]

        def fixed(v, arrays):
            if type(v) is not list or len(v) != len(convs):
                _fail(f"expected a list of {len(convs)} items")
            return tuple(c(x, arrays) for c, x in zip(convs, v))
        return fixed
    if origin in (typing.Union, types.UnionType):
        if len(args) == 2 and type(None) in args:  # X | None, the common case: no exception to try X
            item = _converter(next(t for t in args if t is not type(None)))
            return lambda v, arrays: None if v is None else item(v, arrays)
        convs = [_converter(t) for t in args]

        def union(v, arrays):
            for c in convs:
                try:
                    return c(v, arrays)
                except WireError:
                    pass
            _fail(f"{v!r:.40} is none of {tp}")
        return union
    if dataclasses.is_dataclass(tp) and tp in _NESTED + tuple(KINDS.values()):
        return _dataclass_converter(tp)
    raise TypeError(f"no wire converter for {tp}")


def _dataclass_converter(cls) -> typing.Callable:
    hints = typing.get_type_hints(cls)
    names = _field_names(cls)
    convs = {n: _converter(hints[n]) for n in names}
    field_convs = [convs[n] for n in names]

    def build(v, arrays):
        if type(v) is not list or len(v) != len(names):
            _fail(f"{cls.__name__}: expected a list of its {len(names)} fields")
        try:
            values = [conv(x, arrays) for conv, x in zip(field_convs, v)]
        except WireError:  # again one by one, to name the field
            for name, conv, x in zip(names, field_convs, v):
                try:
                    conv(x, arrays)
                except WireError as e:
                    raise WireError(f"{cls.__name__}.{name}: {e}") from None
            raise
        try:
            return cls(*values)
        except (ValueError, TypeError, AssertionError) as e:  # the class's own checks
            raise WireError(f"{cls.__name__}: {e}") from None
    return build


def decode(payload, expected: tuple[type, ...] = tuple(KINDS.values())):
    """The message in payload, which must be one of the expected kinds; WireError for anything else."""
    try:
        return _decode(memoryview(payload), expected)
    except WireError:
        raise
    except Exception as e:  # RecursionError of a deeply nested header, MemoryError, ...: still just a bad frame
        raise WireError(f"undecodable message: {type(e).__name__}: {e}") from None


def _decode(payload: memoryview, expected: tuple[type, ...]):
    if len(payload) > MAX_PAYLOAD_BYTES:
        _fail(f"message of {len(payload)} bytes is over the limit of {MAX_PAYLOAD_BYTES}")
    if len(payload) < 4:
        _fail("message shorter than its header length")
    (header_len,) = struct.unpack_from("<I", payload)
    if header_len > len(payload) - 4:
        _fail(f"header length {header_len} is past the end of a {len(payload)}-byte message")
    header = json.loads(bytes(payload[4:4 + header_len]))
    if type(header) is not dict or header.keys() != {"kind", "value", "arrays"}:
        _fail("the header must be an object with kind, value and arrays")
    cls = KINDS.get(header["kind"]) if type(header["kind"]) is str else None
    if cls is None or cls not in expected:
        _fail(f"unexpected message kind {header['kind']!r:.40}; expected one of "
              f"{', '.join(c.__name__ for c in expected)}")
    arrays, offset = [], 4 + header_len
    if type(header["arrays"]) is not list:
        _fail("arrays must be a list")
    for spec in header["arrays"]:
        if (type(spec) is not list or len(spec) != 2 or spec[0] not in DTYPES or type(spec[1]) is not list
                or len(spec[1]) > 4 or any(type(d) is not int or d < 0 for d in spec[1])):
            _fail(f"bad array description {spec!r:.60}")
        dtype = DTYPES[spec[0]]
        nbytes = dtype.itemsize * math.prod(spec[1])
        if nbytes > len(payload) - offset:
            _fail(f"array of {nbytes} bytes runs past the end of the message")
        array = np.frombuffer(payload[offset:offset + nbytes], dtype=dtype).reshape(spec[1])
        # The arrays become tensors, which want writable memory: a received bytearray is used in place.
        arrays.append(array if array.flags.writeable else array.copy())
        offset += nbytes
    if offset != len(payload):
        _fail(f"{len(payload) - offset} bytes left over after the arrays")
    return _converter(cls)(header["value"], arrays)

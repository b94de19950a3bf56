"""The weight-bucket codec: plan buckets, encode them as safetensors, check and decode them — no torch.

A tensor travels as `(name, dtype code, shape, raw little-endian bytes)`; a learner holding torch
tensors gets the raw bytes with `t.contiguous().view(torch.uint8).numpy()` (bf16 included). Encoding uses
`safetensors.serialize`, decoding `safetensors.deserialize`; `check_bucket` validates a blob against its
manifest entry from the header alone, so a memory-mapped file is checked without copying its data.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
import safetensors

from shared_schemas.sync import DTYPE_NBYTES, BucketSpec, TensorSpec

__all__ = [
    "DTYPE_CODES",
    "DTYPE_NAMES",
    "BucketMismatchError",
    "RawTensor",
    "bucket_header",
    "bucket_parts",
    "check_bucket",
    "decode_bucket",
    "dtype_code",
    "encode_bucket",
    "plan_buckets",
    "read_header",
]

_MAX_HEADER_BYTES = 100_000_000
"""safetensors' own limit on the JSON header."""

DTYPE_NAMES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "I64": "int64",
    "U64": "uint64",
    "F64": "float64",
}
"""safetensors header code → numpy/torch dtype name (safetensors >= 0.8 builds its `TensorSpec` from these).

The ONE map between the wire's dtype codes and torch dtypes: code that holds torch turns a name into its
dtype with `getattr(torch, name)` (`learner.weights.codec`), so this module never imports torch."""

DTYPE_CODES: dict[str, str] = {name: code for code, name in DTYPE_NAMES.items()}
"""numpy/torch dtype name → safetensors header code (the inverse of `DTYPE_NAMES`)."""


def dtype_code(dtype: Any) -> str:
    """The safetensors code of a torch or numpy dtype or of its name
    (`torch.bfloat16`, `"bfloat16"` → `BF16`).

    Raises:
        ValueError: a dtype the wire cannot carry (complex, quantized, ...), naming the ones it can.
    """
    name = str(dtype).removeprefix("torch.")
    try:
        return DTYPE_CODES[name]
    except KeyError:
        raise ValueError(
            f"dtype {dtype} cannot travel as safetensors; cast to one of {', '.join(DTYPE_CODES)}"
        ) from None


class BucketMismatchError(ValueError):
    """A bucket blob does not match its manifest entry (or is not valid safetensors)."""


class RawTensor(NamedTuple):
    """One tensor as raw bytes."""

    name: str
    dtype: str
    """safetensors dtype code (`F32`, `BF16`, …)."""
    shape: tuple[int, ...]
    data: bytes | bytearray | memoryview
    """Little-endian element data, `prod(shape) * itemsize` bytes."""


def plan_buckets(specs: Sequence[TensorSpec], bucket_bytes: int) -> list[BucketSpec]:
    """Groups tensors, in order, into buckets of at most `bucket_bytes` raw data bytes.

    A tensor larger than `bucket_bytes` gets a bucket of its own; otherwise a bucket is closed when the
    next tensor would overflow it. Order is preserved, so concatenating the buckets gives `specs`.

    Args:
        specs: tensors to send (unique names).
        bucket_bytes: size bound in bytes (> 0), e.g. `rollout.sync.bucket_mb * 2**20`.

    Returns:
        Buckets with indices 0..k-1 (empty list when `specs` is empty).

    Raises:
        ValueError: `bucket_bytes <= 0`.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    groups: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    size = 0
    for spec in specs:
        if current and size + spec.nbytes > bucket_bytes:
            groups.append(current)
            current, size = [], 0
        current.append(spec)
        size += spec.nbytes
    if current:
        groups.append(current)
    return [
        BucketSpec(index=i, tensors=tuple(group), nbytes=sum(t.nbytes for t in group))
        for i, group in enumerate(groups)
    ]


def _expected_nbytes(dtype: str, shape: Sequence[int]) -> int:
    return DTYPE_NBYTES[dtype] * int(np.prod(shape, dtype=np.int64))


def _checked(
    items: Iterable[RawTensor | tuple[str, str, Sequence[int], Any]],
) -> Iterator[tuple[str, str, Sequence[int], memoryview]]:
    """`(name, dtype, shape, byte view)` per tensor, after the codec's checks (dtype, unique name, size)."""
    seen: set[str] = set()
    for name, dtype, shape, data in items:
        if dtype not in DTYPE_NAMES:
            raise ValueError(f"tensor {name!r}: unknown dtype {dtype!r}; use one of {', '.join(DTYPE_NAMES)}")
        if name in seen:
            raise ValueError(f"tensor {name!r} given twice")
        seen.add(name)
        view = memoryview(data).cast("B")
        expected = _expected_nbytes(dtype, shape)
        if view.nbytes != expected:
            raise ValueError(
                f"tensor {name!r}: {view.nbytes} bytes of data, expected {expected} for {dtype} {list(shape)}"
            )
        yield name, dtype, shape, view


def encode_bucket(items: Iterable[RawTensor | tuple[str, str, Sequence[int], Any]]) -> bytes:
    """Encodes tensors as one safetensors blob.

    Args:
        items: `(name, dtype code, shape, raw bytes)` per tensor; raw data may be any buffer.

    Returns:
        The safetensors bytes.

    Raises:
        ValueError: unknown dtype, duplicate name, or data length not matching dtype and shape.
    """
    keep_alive: list[np.ndarray] = []
    flat: dict[str, Any] = {}
    for name, dtype, shape, view in _checked(items):
        buf = np.frombuffer(view, dtype=np.uint8)
        keep_alive.append(buf)
        flat[name] = _tensor_spec(dtype, list(shape), buf)
    return bytes(safetensors.serialize(flat))


def bucket_header(items: Sequence[RawTensor]) -> bytes:
    """The safetensors prefix (8-byte little-endian length + JSON header) of a bucket whose tensor data follow
    back to back in `items` order: header + each tensor's raw bytes IS the safetensors file, so a bucket can
    be written or sent straight from the tensors' memory, without assembling it first.

    The JSON is space-padded to a multiple of 8 bytes (safetensors' alignment), so the data start 8-byte
    aligned and a tensor whose offset is a multiple of its item size can be viewed in place from a mapping.

    Raises:
        ValueError: unknown dtype, duplicate name, or data length not matching dtype and shape.
    """
    header: dict[str, Any] = {}
    offset = 0
    for name, dtype, shape, view in _checked(items):
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + view.nbytes]}
        offset += view.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def bucket_parts(items: Sequence[RawTensor]) -> list[memoryview]:
    """The bucket as buffers to write or send in order: `bucket_header(items)`, then each tensor's bytes
    (views of the caller's memory, not copies)."""
    return [memoryview(bucket_header(items))] + [memoryview(t.data).cast("B") for t in items]


def _tensor_spec(dtype: str, shape: list[int], buf: np.ndarray) -> Any:
    if hasattr(safetensors, "TensorSpec"):
        return safetensors.TensorSpec(
            dtype=DTYPE_NAMES[dtype], shape=shape, data_ptr=buf.ctypes.data, data_len=buf.nbytes
        )
    # safetensors < 0.8 took plain dicts with the header dtype code.
    return {"dtype": dtype, "shape": shape, "data": buf.tobytes()}


def read_header(
    data: bytes | bytearray | memoryview | Any, total_size: int | None = None
) -> dict[str, TensorSpec]:
    """Parses and checks a safetensors header without touching tensor data.

    Args:
        data: the whole blob (bytes, or any buffer such as an `mmap`), or only its beginning (at least the
            header) when `total_size` is given.
        total_size: size of the whole blob when `data` holds only its beginning (a file read in part).

    Returns:
        Name → spec, in header order.

    Raises:
        BucketMismatchError: truncated blob, bad header, unknown dtype, or data offsets that do not
            match dtype × shape or run past the end.
    """
    view = memoryview(data).cast("B")
    if len(view) < 8:
        raise BucketMismatchError(f"bucket is {len(view)} bytes; not a safetensors file")
    (header_len,) = struct.unpack("<Q", view[:8])
    if header_len > _MAX_HEADER_BYTES or 8 + header_len > len(view):
        raise BucketMismatchError(
            f"safetensors header length {header_len} does not fit a {len(view)}-byte file"
        )
    try:
        header = json.loads(bytes(view[8 : 8 + header_len]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BucketMismatchError(f"safetensors header is not valid JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise BucketMismatchError("safetensors header is not a JSON object")
    data_len = (len(view) if total_size is None else total_size) - 8 - header_len
    if data_len < 0:
        raise BucketMismatchError(
            f"safetensors header length {header_len} does not fit a {total_size}-byte file"
        )
    specs: dict[str, TensorSpec] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        specs[name] = _header_entry(name, entry, data_len)
    return specs


def _header_entry(name: str, entry: Any, data_len: int) -> TensorSpec:
    try:
        dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        spec = TensorSpec(name=name, dtype=dtype, shape=shape)
    except (KeyError, TypeError, ValueError) as exc:
        raise BucketMismatchError(f"tensor {name!r}: malformed safetensors header entry") from exc
    if not (0 <= begin <= end <= data_len) or end - begin != spec.nbytes:
        raise BucketMismatchError(
            f"tensor {name!r}: data offsets [{begin}, {end}) do not hold {spec.dtype} {list(spec.shape)}"
            f" within {data_len} data bytes"
        )
    return spec


def check_bucket(
    data: bytes | bytearray | memoryview | Any, expected: BucketSpec, total_size: int | None = None
) -> None:
    """Verifies that a blob holds exactly the tensors of its manifest entry (names, dtypes, shapes).

    Args:
        data: the blob, or its beginning (header included) with `total_size` the whole size.
        expected: the manifest entry.
        total_size: see `read_header`.

    Raises:
        BucketMismatchError: naming the first missing, extra or mismatched tensor.
    """
    found = read_header(data, total_size)
    want = {t.name: t for t in expected.tensors}
    missing = [n for n in want if n not in found]
    if missing:
        raise BucketMismatchError(
            f"bucket {expected.index}: tensor {missing[0]!r} is in the manifest but not in the bucket"
            f" ({len(missing)} missing)"
        )
    extra = [n for n in found if n not in want]
    if extra:
        raise BucketMismatchError(f"bucket {expected.index}: tensor {extra[0]!r} is not in the manifest")
    for name, spec in want.items():
        got = found[name]
        if (got.dtype, got.shape) != (spec.dtype, spec.shape):
            raise BucketMismatchError(
                f"bucket {expected.index}: tensor {name!r} is {got.dtype} {list(got.shape)},"
                f" manifest says {spec.dtype} {list(spec.shape)}"
            )


def decode_bucket(data: bytes, expected: BucketSpec | None = None) -> list[RawTensor]:
    """Decodes a safetensors blob into raw tensors, checked against `expected` when given.

    Returns:
        Tensors in manifest order when `expected` is given, else in file order.

    Raises:
        BucketMismatchError: invalid safetensors or a mismatch with `expected`.
    """
    if expected is not None:
        check_bucket(data, expected)
    try:
        flat = safetensors.deserialize(bytes(data))
    except (safetensors.SafetensorError, ValueError) as exc:
        raise BucketMismatchError(f"bucket is not valid safetensors: {exc}") from exc
    tensors = {name: RawTensor(name, t["dtype"], tuple(t["shape"]), bytes(t["data"])) for name, t in flat}
    if expected is None:
        return list(tensors.values())
    return [tensors[t.name] for t in expected.tensors]

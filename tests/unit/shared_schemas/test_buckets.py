"""Weight-bucket codec and sync manifest (docs/ARCHITECTURE.md#sync-weights)."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from pydantic import ValidationError

from shared_schemas.buckets import (
    DTYPE_CODES,
    DTYPE_NAMES,
    BucketMismatchError,
    RawTensor,
    bucket_header,
    bucket_parts,
    check_bucket,
    decode_bucket,
    dtype_code,
    encode_bucket,
    plan_buckets,
    read_header,
)
from shared_schemas.sync import DTYPE_NBYTES, BucketSpec, ShmBucketRef, SyncManifest, TensorSpec


def spec(name: str, dtype: str, *shape: int) -> TensorSpec:
    return TensorSpec(name=name, dtype=dtype, shape=shape)


def raw(name: str, dtype: str, shape: tuple[int, ...], seed: int = 0) -> RawTensor:
    size = spec(name, dtype, *shape).nbytes
    return RawTensor(
        name, dtype, shape, np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()
    )


def test_plan_respects_bound_and_order() -> None:
    specs = [spec(f"t{i}", "F32", 10) for i in range(7)]  # 40 bytes each
    buckets = plan_buckets(specs, 100)
    assert [len(b.tensors) for b in buckets] == [2, 2, 2, 1]
    assert [t for b in buckets for t in b.tensors] == specs
    assert all(b.nbytes <= 100 for b in buckets)
    assert [b.index for b in buckets] == [0, 1, 2, 3]


def test_oversize_tensor_gets_its_own_bucket() -> None:
    specs = [spec("a", "F32", 2), spec("big", "F32", 100), spec("b", "F32", 2)]
    buckets = plan_buckets(specs, 64)
    assert [[t.name for t in b.tensors] for b in buckets] == [["a"], ["big"], ["b"]]
    assert buckets[1].nbytes == 400


def test_plan_edge_cases() -> None:
    assert plan_buckets([], 10) == []
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets([spec("a", "F32", 1)], 0)


def test_round_trip_with_bf16_raw_bytes() -> None:
    torch = pytest.importorskip("torch")
    weight = torch.randn(3, 5).to(torch.bfloat16)
    items = [
        RawTensor("w", "BF16", (3, 5), weight.view(torch.uint8).numpy().tobytes()),
        raw("b", "F32", (5,)),
        raw("s", "I64", ()),
        RawTensor("empty", "F16", (0, 4), b""),
    ]
    bucket = plan_buckets([spec(t.name, t.dtype, *t.shape) for t in items], 1 << 20)[0]
    blob = encode_bucket(items)
    check_bucket(blob, bucket)
    decoded = decode_bucket(blob, bucket)
    assert decoded == [RawTensor(t.name, t.dtype, t.shape, bytes(t.data)) for t in items]
    back = torch.frombuffer(bytearray(decoded[0].data), dtype=torch.bfloat16).reshape(3, 5)
    assert torch.equal(back, weight)
    # The learner side may also read it with safetensors' torch loader.
    from safetensors.torch import load

    assert torch.equal(load(blob)["w"], weight)


def test_encode_accepts_buffers_without_copy() -> None:
    arr = np.arange(6, dtype=np.float32).reshape(2, 3)
    blob = encode_bucket([("x", "F32", (2, 3), arr)])
    (out,) = decode_bucket(blob)
    assert np.frombuffer(out.data, dtype=np.float32).reshape(2, 3).tolist() == arr.tolist()


@pytest.mark.parametrize(
    ("items", "fragment"),
    [
        ([("a", "F32", (2,), b"\x00" * 7)], "expected 8"),
        ([("a", "Q4", (2,), b"\x00" * 8)], "unknown dtype"),
        ([("a", "F32", (1,), b"\x00" * 4), ("a", "F32", (1,), b"\x00" * 4)], "twice"),
    ],
    ids=["short-data", "bad-dtype", "duplicate"],
)
def test_encode_rejects_bad_items(
    items: list[tuple[str, str, tuple[int, ...], bytes]], fragment: str
) -> None:
    with pytest.raises(ValueError, match=fragment):
        encode_bucket(items)


@pytest.fixture
def blob_and_spec() -> tuple[bytes, BucketSpec]:
    items = [raw("a", "F32", (2, 3)), raw("b", "BF16", (4,))]
    return encode_bucket(items), plan_buckets([spec("a", "F32", 2, 3), spec("b", "BF16", 4)], 1 << 20)[0]


@pytest.mark.parametrize(
    ("manifest_tensors", "fragment"),
    [
        ([spec("a", "F32", 3, 2), spec("b", "BF16", 4)], "manifest says F32 \\[3, 2\\]"),
        ([spec("a", "F16", 2, 3), spec("b", "BF16", 4)], "manifest says F16"),
        ([spec("a", "F32", 2, 3)], "'b' is not in the manifest"),
        (
            [spec("a", "F32", 2, 3), spec("b", "BF16", 4), spec("c", "F32", 1)],
            "'c' is in the manifest but not",
        ),
    ],
    ids=["shape", "dtype", "extra", "missing"],
)
def test_check_bucket_mismatches(
    blob_and_spec: tuple[bytes, BucketSpec], manifest_tensors: list[TensorSpec], fragment: str
) -> None:
    blob, _ = blob_and_spec
    expected = BucketSpec(
        index=0, tensors=tuple(manifest_tensors), nbytes=sum(t.nbytes for t in manifest_tensors)
    )
    with pytest.raises(BucketMismatchError, match=fragment):
        check_bucket(blob, expected)
    with pytest.raises(BucketMismatchError):
        decode_bucket(blob, expected)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda b: b[:5],
        lambda b: struct.pack("<Q", 10**12) + b[8:],
        lambda b: b[:8] + b"{" * (len(b) - 8),
        lambda b: b[:-3],
    ],
    ids=["tiny", "huge-header", "garbage-header", "truncated-data"],
)
def test_corrupt_blobs_are_rejected(blob_and_spec: tuple[bytes, BucketSpec], mutate) -> None:  # noqa: ANN001
    blob, bucket = blob_and_spec
    with pytest.raises(BucketMismatchError):
        check_bucket(mutate(blob), bucket)


def test_read_header_from_memoryview(blob_and_spec: tuple[bytes, BucketSpec]) -> None:
    blob, bucket = blob_and_spec
    assert set(read_header(memoryview(blob))) == {t.name for t in bucket.tensors}


def manifest(**kw: object) -> dict[str, object]:
    buckets = [b.model_dump() for b in plan_buckets([spec("a", "F32", 2), spec("b", "F32", 2)], 8)]
    return {"mode": "full", "version": 1, "buckets": buckets, **kw}


def test_manifest_valid() -> None:
    m = SyncManifest.model_validate(manifest())
    assert m.nbytes == 16 and [t.name for t in m.tensors] == ["a", "b"]


@pytest.mark.parametrize(
    ("kw", "fragment"),
    [
        ({"version": 0}, "version"),
        ({"buckets": []}, "buckets"),
        ({"mode": "merge"}, "mode"),
        ({"mode": "adapter"}, "adapter_name and adapter_config"),
        ({"adapter_name": "x"}, "takes no adapter"),
    ],
)
def test_manifest_rules(kw: dict[str, object], fragment: str) -> None:
    with pytest.raises(ValidationError, match=fragment):
        SyncManifest.model_validate(manifest(**kw))


def test_manifest_bucket_rules() -> None:
    good = manifest()["buckets"]
    swapped = [dict(good[1], index=0), dict(good[0], index=0)]  # type: ignore[index]
    with pytest.raises(ValidationError, match="indices"):
        SyncManifest.model_validate(manifest(buckets=swapped))
    dup = [good[0], dict(good[0], index=1)]  # type: ignore[index]
    with pytest.raises(ValidationError, match="more than one bucket"):
        SyncManifest.model_validate(manifest(buckets=dup))
    with pytest.raises(ValidationError, match="nbytes"):
        BucketSpec(index=0, tensors=(spec("a", "F32", 2),), nbytes=9)
    with pytest.raises(ValidationError, match="unknown dtype"):
        spec("a", "float32", 2)


@pytest.mark.parametrize("name", ["../etc/passwd", "a/b", "..", ".", "a\\b", "x\x00y", ""])
def test_shm_ref_refuses_paths(name: str) -> None:
    with pytest.raises(ValidationError):
        ShmBucketRef(file_name=name)


def test_bucket_parts_form_a_valid_aligned_safetensors_file() -> None:
    items = [raw("a", "F32", (3, 2)), raw("odd", "U8", (3,)), raw("b", "BF16", (4,), seed=1)]
    blob = b"".join(bytes(p) for p in bucket_parts(items))
    (header_len,) = struct.unpack("<Q", blob[:8])
    assert header_len % 8 == 0
    expected = BucketSpec(
        index=0,
        tensors=tuple(spec(t.name, t.dtype, *t.shape) for t in items),
        nbytes=sum(len(t.data) for t in items),
    )
    check_bucket(blob, expected)
    assert [(t.name, bytes(t.data)) for t in decode_bucket(blob, expected)] == [
        (t.name, t.data) for t in items
    ]
    check_bucket(blob[: 8 + header_len], expected, total_size=len(blob))  # header alone + the file size
    with pytest.raises(BucketMismatchError):
        check_bucket(blob[: 8 + header_len], expected, total_size=len(blob) - 1)


def test_bucket_header_refuses_wrong_sizes() -> None:
    with pytest.raises(ValueError, match="expected 24"):
        bucket_header([RawTensor("a", "F32", (3, 2), b"\0" * 20)])


def test_one_dtype_table_both_ways() -> None:
    """Every wire code has one dtype name and back; torch dtypes and their names give the same code."""
    assert set(DTYPE_NAMES) == set(DTYPE_NBYTES)
    assert {DTYPE_CODES[name]: name for name in DTYPE_CODES} == DTYPE_NAMES
    torch = pytest.importorskip("torch")
    for code, name in DTYPE_NAMES.items():
        assert dtype_code(getattr(torch, name)) == dtype_code(name) == code
    assert dtype_code(np.dtype("float32")) == "F32"
    with pytest.raises(ValueError, match="cannot travel as safetensors"):
        dtype_code(torch.complex64)

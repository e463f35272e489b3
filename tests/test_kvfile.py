"""KV file format (tierattn.storage.kvfile): round trips, atomic writes, a catalogue of corrupted
files and seeded fuzzing.

``TIERATTN_FUZZ_CASES`` (default 2000) sets the number of fuzzed mutations; ``TIERATTN_TEST_SEED``
shifts their seeds. A failing fuzz case prints its seed; ``_mutate(BASE_RAW, random.Random(seed))``
rebuilds the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import stat
import tempfile
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import safetensors.torch
import torch

from tierattn.storage import kvfile
from tierattn.errors import KVFileError
from tierattn.storage.kvfile import (
    DTYPES, FORMAT_VERSION, MAX_HEADER_BYTES, expect, kv_file_name, read_kv_file, read_kv_header,
    write_kv_file,
)

MAX_BYTES = 8 << 20
META = {"kind": "page", "fingerprint": "f00dfeed", "layer": "3", "page_size": "16",
        "token_start": "32", "token_end": "48", "note": "x"}
# the caller's expectation: every field but "note", which only the checksum protects
EXPECT_META = {k: v for k, v in META.items() if k != "note"}


def base_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "k": torch.randn(2, 3, 4, generator=g).to(torch.float16),
        "v": torch.randn(2, 3, 4, generator=g).to(torch.bfloat16),
        "pos": torch.arange(32, 37, dtype=torch.int64),
        "mask": torch.zeros(0, 7, dtype=torch.uint8),
        "scale": torch.tensor([0.5, 2.0], dtype=torch.float32),
    }


BASE = base_tensors()
SPEC = {name: (t.dtype, tuple(t.shape)) for name, t in BASE.items()}


def _check(header: kvfile.KVHeader) -> None:
    expect(header, meta=EXPECT_META, tensors=SPEC)


def _raw_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_bitwise_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        g = got[name]
        assert g.device.type == "cpu" and g.dtype == t.dtype and g.shape == t.shape, name
        assert torch.equal(_raw_bytes(g), _raw_bytes(t)), name


def _make_base_raw() -> bytes:
    with tempfile.TemporaryDirectory() as d:
        return write_kv_file(d, "base", BASE, META).read_bytes()


BASE_RAW = _make_base_raw()


def split(raw: bytes) -> tuple[dict, bytes]:
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def join(header: object, data: bytes, *, pad: bool = True) -> bytes:
    text = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + data


def checksum(header: dict, data: bytes) -> str:
    """The documented checksum, computed independently of kvfile: SHA-256 of the canonical
    header without the checksum (sorted keys, compact, ASCII) followed by the data region."""
    h = json.loads(json.dumps(header))
    h["__metadata__"].pop("checksum", None)
    canon = json.dumps(h, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    return hashlib.sha256(canon + data).hexdigest()


def decode(raw: bytes) -> dict[str, torch.Tensor]:
    """An independent reading of a well-formed file (the oracle for forged fuzz cases)."""
    header, data = split(raw)
    out = {}
    for name, e in header.items():
        if name != "__metadata__":
            start, end = e["data_offsets"]
            flat = torch.frombuffer(bytearray(data[start:end]) or bytearray(1), dtype=torch.uint8)
            out[name] = flat[:end - start].view(DTYPES[e["dtype"]]).reshape(e["shape"])
    return out


BASE_HEADER, BASE_DATA = split(BASE_RAW)
BASE_N = int.from_bytes(BASE_RAW[:8], "little")
# tensors in data order, with their offsets in the file
LAYOUT = sorted(((name, *e["data_offsets"]) for name, e in BASE_HEADER.items()
                 if name != "__metadata__"), key=lambda x: (x[1], x[2]))


# -- round trips ------------------------------------------------------------------------------

NAN_PAYLOADS = {
    torch.float16: [0x7E01, 0xFE55, 0x7C01],
    torch.bfloat16: [0x7FC1, 0xFF81, 0x7F81],
    torch.float32: [0x7FC00001, 0xFFC12345, 0x7F800001],
    torch.float64: [0x7FF8000000000001, 0xFFF0000000000ABC - (1 << 64)],
}


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    n = 1
    for d in shape:
        n *= d
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    t = raw.view(dtype).reshape(shape).clone()
    if dtype in NAN_PAYLOADS and n >= len(NAN_PAYLOADS[dtype]):
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
        vals = [v - (1 << 16) if ints == torch.int16 and v >= 1 << 15 else
                v - (1 << 32) if ints == torch.int32 and v >= 1 << 31 else v
                for v in NAN_PAYLOADS[dtype]]
        t.reshape(-1)[:len(vals)] = torch.tensor(vals, dtype=ints).view(dtype)
    return t


@pytest.mark.parametrize("code", list(DTYPES), ids=lambda c: f"dtype-{c}")
def test_round_trip_every_dtype_bitwise(tmp_path, code, seed):
    dtype = DTYPES[code]
    gen = torch.Generator().manual_seed(seed)
    tensors = {
        "scalar": random_bits((), dtype, gen),
        "vector": random_bits((17,), dtype, gen),
        "page": random_bits((2, 16, 3, 5), dtype, gen),
        "empty": random_bits((3, 0, 2), dtype, gen),
        "empty1": random_bits((0,), dtype, gen),
    }
    if dtype.is_floating_point:
        assert tensors["page"].isnan().any()  # the NaN payloads are in the file
    path = write_kv_file(tmp_path, "k", tensors, META)
    spec = {n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()}
    got = read_kv_file(path, lambda h: expect(h, meta=META, tensors=spec), max_file_bytes=MAX_BYTES)
    assert_bitwise_equal(got, tensors)
    header = read_kv_header(path, max_file_bytes=MAX_BYTES)
    assert header.meta == {"format_version": str(FORMAT_VERSION), **META,
                           "checksum": header.meta["checksum"]}


def test_round_trip_mixed_tensors_meta_and_layout(tmp_path):
    src = dict(BASE, strided=torch.arange(24, dtype=torch.int32).reshape(4, 6).t())
    path = write_kv_file(tmp_path, "mixed", src, META)
    spec = {n: (t.dtype, tuple(t.shape)) for n, t in src.items()}
    got = read_kv_file(path, lambda h: expect(h, meta=META, tensors=spec), max_file_bytes=MAX_BYTES)
    want = {n: t.contiguous() for n, t in src.items()}
    assert_bitwise_equal(got, want)
    assert_bitwise_equal(safetensors.torch.load_file(path), want)  # plain safetensors reads it
    header, data = split(path.read_bytes())
    assert (8 + int.from_bytes(path.read_bytes()[:8], "little")) % 8 == 0
    assert header["__metadata__"]["checksum"] == checksum(header, data)
    # largest item size first, then by name: every tensor aligned to its item size
    entries = sorted(((e["data_offsets"][0], n, DTYPES[e["dtype"]].itemsize)
                      for n, e in header.items() if n != "__metadata__"))
    assert [n for _, n, _ in entries] == ["pos", "scale", "strided", "k", "v", "mask"]
    assert all(start % size == 0 for start, _, size in entries)
    for t in got.values():  # each result owns its memory: writing it changes nothing else
        t.reshape(-1)[:1] = 0
    assert_bitwise_equal(read_kv_file(path, lambda h: expect(h, meta=META, tensors=spec),
                                      max_file_bytes=MAX_BYTES), want)


def test_file_name_is_a_digest_of_the_key(tmp_path):
    keys = ["../../etc/passwd", "/abs/path", "a/b\\c", "", "ü\x00\ud800", "x" * 10_000]
    names = [kv_file_name(k) for k in keys]
    assert all(re.fullmatch(r"[0-9a-f]{32}\.safetensors", n) for n in names)
    assert len(set(names)) == len(keys)
    assert kv_file_name("layer3/page7") == kv_file_name("layer3/page7")
    sub = tmp_path / "tier"
    sub.mkdir()
    path = write_kv_file(sub, "../../etc/passwd", BASE, META)
    assert path.parent == sub and path.name == names[0]
    assert sorted(p.name for p in tmp_path.rglob("*")) == sorted(["tier", names[0]])


# -- atomic writes ----------------------------------------------------------------------------

def test_existing_file_is_replaced_not_modified(tmp_path):
    path = write_kv_file(tmp_path, "k", BASE, META)
    before = path.read_bytes()
    ino = path.stat().st_ino
    with path.open("rb") as old:  # a reader holding the old file keeps reading the old bytes
        changed = dict(BASE, k=BASE["k"] + 1)
        assert write_kv_file(tmp_path, "k", changed, META) == path
        assert old.read() == before
    assert path.stat().st_ino != ino
    got = read_kv_file(path, _check, max_file_bytes=MAX_BYTES)
    assert_bitwise_equal(got, changed)
    assert os.listdir(tmp_path) == [path.name]
    assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0  # private to the owner


@pytest.mark.parametrize("fail_at", ["replace", "fsync", "write"])
def test_failed_write_leaves_old_file_intact_and_no_temp(tmp_path, monkeypatch, fail_at):
    path = write_kv_file(tmp_path, "k", BASE, META)
    before = path.read_bytes()

    def boom(*args, **kwargs):
        raise OSError(28, "No space left on device (simulated)")

    if fail_at == "write":  # fail midway through the data
        real = kvfile.os.fdopen

        class Half:
            def __init__(self, f):
                self.f, self.calls = f, 0

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.f.close()

            def write(self, b):
                self.calls += 1
                if self.calls == 4:
                    boom()
                return self.f.write(b)

            def __getattr__(self, name):
                return getattr(self.f, name)

        monkeypatch.setattr(kvfile.os, "fdopen", lambda *a, **k: Half(real(*a, **k)))
    else:
        monkeypatch.setattr(kvfile.os, fail_at, boom)
    with pytest.raises(OSError, match="simulated"):
        write_kv_file(tmp_path, "k", dict(BASE, k=BASE["k"] * 2), META)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == [path.name]
    assert path.read_bytes() == before


@pytest.mark.parametrize("tensors, meta, match", [
    pytest.param({"a": torch.zeros(2, dtype=torch.int8)}, {}, "dtype torch.int8", id="int8"),
    pytest.param({"a": torch.zeros(2, dtype=torch.bool)}, {}, "dtype torch.bool", id="bool"),
    pytest.param({"a": torch.zeros(2, dtype=torch.complex64)}, {}, "dtype", id="complex"),
    pytest.param({"a": torch.zeros(2, dtype=torch.float8_e4m3fn)}, {}, "dtype", id="fp8"),
    pytest.param({"a": torch.zeros([1] * 9)}, {}, "rank 9", id="rank9"),
    pytest.param({"a": torch.zeros(2).to_sparse()}, {}, "dense", id="sparse"),
    pytest.param({"a": torch.zeros(2, device="meta")}, {}, "dense", id="meta-device"),
    pytest.param({"a": [1.0]}, {}, "not a tensor", id="not-a-tensor"),
    pytest.param({"__x": torch.zeros(2)}, {}, "tensor name", id="name-reserved"),
    pytest.param({"": torch.zeros(2)}, {}, "tensor name", id="name-empty"),
    pytest.param({1: torch.zeros(2)}, {}, "tensor name", id="name-int"),
    pytest.param({"\ud800": torch.zeros(2)}, {}, "UTF-8", id="name-surrogate"),
    pytest.param({}, {"checksum": "0"}, "reserved", id="meta-checksum"),
    pytest.param({}, {"format_version": "1"}, "reserved", id="meta-version"),
    pytest.param({}, {"layer": 3}, "str -> str", id="meta-int-value"),
    pytest.param({}, {"x": "\udfff"}, "UTF-8", id="meta-surrogate"),
])
def test_write_rejects_what_it_cannot_store(tmp_path, tensors, meta, match):
    with pytest.raises(KVFileError, match=match):
        write_kv_file(tmp_path, "k", tensors, meta)
    assert os.listdir(tmp_path) == []


def test_write_rejects_a_header_over_the_limit(tmp_path):
    with pytest.raises(KVFileError, match="MAX_HEADER_BYTES"):
        write_kv_file(tmp_path, "k", {}, {"big": "x" * MAX_HEADER_BYTES})
    assert os.listdir(tmp_path) == []


def test_empty_file_set_round_trips(tmp_path):
    path = write_kv_file(tmp_path, "none", {}, {})
    assert read_kv_file(path, lambda h: expect(h, meta={}, tensors={}),
                        max_file_bytes=MAX_BYTES) == {}


# -- reading: API behaviour -------------------------------------------------------------------

def test_header_read_touches_no_data_and_check_runs_before_data(tmp_path, monkeypatch):
    path = tmp_path / "base.safetensors"
    path.write_bytes(BASE_RAW)
    sizes: list[int] = []
    real = kvfile._buffer
    monkeypatch.setattr(kvfile, "_buffer", lambda n: sizes.append(n) or real(n))
    header = read_kv_header(path, max_file_bytes=MAX_BYTES)
    assert sizes == [8, BASE_N]
    assert header.size == len(BASE_RAW) and header.data_start == 8 + BASE_N
    assert list(header.tensors) == [name for name, _, _ in LAYOUT]
    assert header.tensors["k"] == kvfile.TensorEntry("k", torch.float16, (2, 3, 4),
                                                     *BASE_HEADER["k"]["data_offsets"])

    class Refused(Exception):
        pass

    def refuse(h):
        raise Refused

    sizes.clear()
    with pytest.raises(Refused):  # the caller's own exception passes through unchanged
        read_kv_file(path, refuse, max_file_bytes=MAX_BYTES)
    assert sizes == [8, BASE_N]


@pytest.mark.parametrize("bad", [0, 7, -1, 2.5, True, None], ids=repr)
def test_bad_max_file_bytes_argument(tmp_path, bad):
    with pytest.raises(ValueError, match="max_file_bytes"):
        read_kv_header(tmp_path, max_file_bytes=bad)


def test_expect_requires_string_meta_values(tmp_path):
    path = write_kv_file(tmp_path, "k", BASE, META)
    header = read_kv_header(path, max_file_bytes=MAX_BYTES)
    with pytest.raises(TypeError, match="'layer'"):
        expect(header, meta={"layer": 3}, tensors=SPEC)


def test_source_has_no_unsafe_loading_and_no_mappings():
    src = Path(kvfile.__file__).read_text()
    for pattern in (r"\bpickle\b", r"torch\.load\(", r"np\.load", r"allow_pickle", r"\bmmap\b",
                    r"safe_open", r"\beval\(", r"\bexec\("):
        assert not re.search(pattern, src), pattern


# -- catalogue of corrupted files -------------------------------------------------------------

@dataclass
class Bad:
    """A corrupted file: ``make(tmp_path)`` returns the path to read."""

    make: Callable[[Path], Path]
    match: str | None  # a fragment of the expected message (None: any KVFileError)
    max_file_bytes: int = MAX_BYTES


def raw_case(mutate: Callable[[bytes], bytes], match: str | None) -> Bad:
    def make(tmp: Path) -> Path:
        p = tmp / "bad.safetensors"
        p.write_bytes(mutate(BASE_RAW))
        return p
    return Bad(make, match)


def header_case(edit: Callable[[dict], object], match: str | None) -> Bad:
    """Edit a copy of the parsed header in place (the return value is ignored)."""
    def mutate(raw: bytes) -> bytes:
        header, data = split(raw)
        edit(header)
        return join(header, data)
    return raw_case(mutate, match)


def text_case(edit: Callable[[str], str], match: str | None) -> Bad:
    """Edit the header text itself (with a matching header length)."""
    def mutate(raw: bytes) -> bytes:
        n = int.from_bytes(raw[:8], "little")
        text = edit(raw[8:8 + n].decode()).encode("utf-8", "surrogatepass")
        return len(text).to_bytes(8, "little") + text + raw[8 + n:]
    return raw_case(mutate, match)


def with_len(n: int) -> Callable[[bytes], bytes]:
    return lambda raw: n.to_bytes(8, "little") + raw[8:]


def flip(pos: int, bit: int = 0) -> Callable[[bytes], bytes]:
    return lambda raw: raw[:pos] + bytes([raw[pos] ^ (1 << bit)]) + raw[pos + 1:]


def written(key: str, tensors: dict | None = None, meta: dict | None = None) -> Bad:
    """A structurally valid file that the caller's ``expect`` must refuse."""
    def make(tmp: Path) -> Path:
        return write_kv_file(tmp, key, BASE if tensors is None else tensors,
                             META if meta is None else meta)
    return Bad(make, None)


def entry(name: str, **fields) -> Callable[[dict], None]:
    def edit(h: dict) -> None:
        for k, v in fields.items():
            if v is ...:
                del h[name][k]
            else:
                h[name][k] = v
    return edit


def meta_edit(**fields) -> Callable[[dict], None]:
    def edit(h: dict) -> None:
        for k, v in fields.items():
            if v is ...:
                del h["__metadata__"][k]
            else:
                h["__metadata__"][k] = v
    return edit


def shift(name: str, by: int) -> Callable[[dict], None]:
    return lambda h: h[name].update(data_offsets=[o + by for o in h[name]["data_offsets"]])


def header_pos(text: str) -> int:
    """Absolute file offset of the first occurrence of ``text`` in the base header."""
    return 8 + BASE_RAW[8:8 + BASE_N].index(text.encode())


def dir_case(tmp: Path) -> Path:
    (tmp / "d").mkdir()
    return tmp / "d"


def symlink_to_dir(tmp: Path) -> Path:
    (tmp / "d").mkdir()
    (tmp / "link").symlink_to(tmp / "d")
    return tmp / "link"


def dangling_symlink(tmp: Path) -> Path:
    (tmp / "link").symlink_to(tmp / "gone")
    return tmp / "link"


def fifo(tmp: Path) -> Path:
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs on this platform")
    os.mkfifo(tmp / "fifo")
    return tmp / "fifo"


def _second(name: str) -> str:
    return LAYOUT[[n for n, _, _ in LAYOUT].index(name) + 1][0]


_NONEMPTY = [(n, s, e) for n, s, e in LAYOUT if e > s]
_TRUNCATIONS = {
    "in-length-field": 4,
    "after-length-field": 8,
    "mid-header": 8 + BASE_N // 2,
    "end-of-header": 8 + BASE_N,
    **{f"end-of-{n}": 8 + BASE_N + e for n, _, e in _NONEMPTY[:-1]},
    **{f"mid-{n}": 8 + BASE_N + (s + e) // 2 for n, s, e in _NONEMPTY},
    "last-byte": len(BASE_RAW) - 1,
}
_TRUNCATION_MATCH = {4: "too short", 8: "header length", 8 + BASE_N // 2: "header length"}

CATALOGUE = {
    # size and header length
    "empty-file": raw_case(lambda r: b"", "too short"),
    "seven-bytes": raw_case(lambda r: r[:7], "too short"),
    "header-len-0": raw_case(with_len(0), "header length 0 "),
    "header-len-1": raw_case(with_len(1), "header length 1 "),
    "header-len-past-eof": raw_case(with_len(len(BASE_RAW)), "header length"),
    "header-len-2**63": raw_case(with_len(2**63), "header length"),
    "header-len-2**64-1": raw_case(with_len(2**64 - 1), "header length"),
    "header-len-over-1MiB": raw_case(
        lambda r: with_len(MAX_HEADER_BYTES + 1)(r) + b" " * (2 * MAX_HEADER_BYTES),
        "header length"),
    "header-len-minus-1": raw_case(with_len(BASE_N - 1), None),
    "header-len-plus-1": raw_case(with_len(BASE_N + 1), None),
    # header text
    "header-not-utf8": raw_case(lambda r: r.replace(b'"note":"x"', b'"note":"\xff"'),
                                "not UTF-8"),
    "header-not-json": text_case(lambda t: t.rstrip()[:-1], "not valid JSON"),
    "header-json-array": text_case(lambda t: "[1, 2]", "JSON list"),
    "header-json-string": text_case(lambda t: '"header"', "JSON str"),
    "header-json-null": text_case(lambda t: "null", "JSON NoneType"),
    "header-json-empty-object": text_case(lambda t: "{}", "'__metadata__'"),
    "header-json-nan": text_case(lambda t: t.replace('"shape":[5]', '"shape":[NaN]'),
                                 "not valid JSON"),
    "header-duplicate-key": text_case(lambda t: t.replace('{"__metadata__"',
                                                          '{"k":{},"__metadata__"'),
                                      "duplicate key 'k'"),
    "header-deeply-nested": text_case(lambda t: "[" * 200_000 + "]" * 200_000,
                                      "not valid JSON"),
    "header-huge-int": text_case(lambda t: t.replace('"shape":[5]', '"shape":[' + "9" * 4000
                                                     + "]"), "not valid JSON"),
    # metadata
    "metadata-missing": header_case(lambda h: h.pop("__metadata__"), "'__metadata__'"),
    "metadata-not-object": header_case(lambda h: h.update(__metadata__=[["a", "b"]]),
                                       "'__metadata__'"),
    "metadata-value-int": header_case(meta_edit(layer=3), "'layer' must be a string"),
    "metadata-value-null": header_case(meta_edit(note=None), "'note' must be a string"),
    "metadata-lone-surrogate": text_case(lambda t: t.replace('"note":"x"', '"note":"\\ud800"'),
                                         "not valid UTF-8"),
    "format-version-2": header_case(meta_edit(format_version="2"), "'format_version'"),
    "format-version-missing": header_case(meta_edit(format_version=...), "'format_version'"),
    "format-version-int": header_case(meta_edit(format_version=1), "must be a string"),
    "checksum-missing": header_case(meta_edit(checksum=...), "'checksum'"),
    "checksum-uppercase": header_case(lambda h: meta_edit(
        checksum=h["__metadata__"]["checksum"].upper())(h), "'checksum'"),
    "checksum-short": header_case(meta_edit(checksum="00"), "'checksum'"),
    # top level and entries
    "unknown-top-level-key": header_case(lambda h: h.update(__extra__={}), "unknown top-level"),
    "empty-tensor-name": header_case(lambda h: h.update({"": h.pop("scale")}),
                                     "unknown top-level"),
    "entry-extra-field": header_case(entry("k", align=8), "exactly"),
    "entry-missing-offsets": header_case(entry("k", data_offsets=...), "exactly"),
    "entry-not-object": header_case(lambda h: h.update(k=[1, 2]), "exactly"),
    "dtype-I8": header_case(entry("mask", dtype="I8"), "dtype 'I8' is not allowed"),
    "dtype-F8_E4M3": header_case(entry("mask", dtype="F8_E4M3"), "not allowed"),
    "dtype-BOOL": header_case(entry("mask", dtype="BOOL"), "not allowed"),
    "dtype-lowercase": header_case(entry("k", dtype="f16"), "not allowed"),
    "dtype-not-string": header_case(entry("k", dtype=2), "not allowed"),
    "shape-negative": header_case(entry("k", shape=[-2, 3, 4]), "shape must be"),
    "shape-not-list": header_case(entry("k", shape="2,3,4"), "shape must be"),
    "shape-float-dim": header_case(entry("k", shape=[2.0, 3, 4]), "shape must be"),
    "shape-bool-dim": header_case(entry("pos", shape=[True] * 5), "shape must be"),
    "shape-rank-9": header_case(entry("mask", shape=[0] + [1] * 8), "shape must be"),
    "shape-x-dtype-mismatch": header_case(entry("k", shape=[2, 3, 5]), "60 bytes but"),
    "shape-huge-claims": header_case(entry("k", shape=[2**40, 2**20]), "bytes but"),
    "shape-overflows-int64": header_case(entry("k", shape=[2**40, 2**40]), "too large"),
    "shape-empty-overflows-int64": header_case(entry("mask", shape=[0, 2**62, 2**62]),
                                               "too large"),
    "shape-dim-2**64": header_case(entry("mask", shape=[0, 2**64]), "too large"),
    "offsets-reversed": header_case(lambda h: h["k"]["data_offsets"].reverse(),
                                    "data_offsets must be"),
    "offsets-negative": header_case(shift(LAYOUT[0][0], -8), "data_offsets must be"),
    "offsets-three": header_case(lambda h: h["k"]["data_offsets"].append(0),
                                 "data_offsets must be"),
    "offsets-float": header_case(entry("k", data_offsets=[0.0, 48.0]), "data_offsets must be"),
    "offsets-overlap": header_case(shift(_second(LAYOUT[0][0]), -4), "overlaps"),
    "offsets-gap": header_case(shift(_second(LAYOUT[0][0]), 4), "leaves a gap"),
    "offsets-huge": header_case(entry("mask", shape=[2**40], data_offsets=[2**62, 2**62 + 2**40]),
                                "leaves a gap"),
    "trailing-bytes": raw_case(lambda r: r + b"\0", "1 trailing bytes"),
    "trailing-block": raw_case(lambda r: r + b"\0" * 8, "8 trailing bytes"),
    # truncations at every boundary and inside every tensor
    **{f"truncated-{what}": raw_case(lambda r, at=at: r[:at],
                                     _TRUNCATION_MATCH.get(at, "past the data region"))
       for what, at in _TRUNCATIONS.items()},
    # flipped bits
    "bit-flip-data": raw_case(flip(8 + BASE_N + len(BASE_DATA) // 2, 3), "checksum mismatch"),
    "bit-flip-last-data-byte": raw_case(flip(len(BASE_RAW) - 1, 7), "checksum mismatch"),
    "bit-flip-header-unchecked-meta": raw_case(flip(header_pos('"note":"x"') + 8, 0),
                                               "checksum mismatch"),
    "bit-flip-header-checksum": raw_case(flip(header_pos('"checksum":"') + 12, 0),
                                         "checksum mismatch"),
    "bit-flip-header-fingerprint": raw_case(flip(header_pos("f00dfeed"), 0), "'fingerprint'"),
    "bit-flip-header-shape": raw_case(flip(header_pos('"shape":[5]') + 9, 0), "bytes but"),
    "bit-flip-header-padding": raw_case(flip(8 + BASE_N - 1, 1), None),
    "bit-flip-header-length": raw_case(flip(0, 4), None),
    # valid files refused by the caller's expectation
    "expect-unknown-tensor": written("x", dict(BASE, extra=torch.zeros(1))),
    "expect-missing-tensor": written("x", {k: v for k, v in BASE.items() if k != "v"}),
    "expect-wrong-dtype": written("x", dict(BASE, k=BASE["k"].float())),
    "expect-wrong-shape": written("x", dict(BASE, k=BASE["k"].reshape(2, 4, 3))),
    "expect-wrong-fingerprint": written("x", meta=dict(META, fingerprint="0ther")),
    "expect-wrong-layer": written("x", meta=dict(META, layer="4")),
    "expect-wrong-kind": written("x", meta=dict(META, kind="saved-cache")),
    "expect-wrong-token-range": written("x", meta=dict(META, token_end="49")),
    "expect-missing-meta-key": written("x", meta={k: v for k, v in META.items()
                                                  if k != "page_size"}),
    # not a readable regular file
    "directory": Bad(dir_case, "a directory"),
    "symlink-to-directory": Bad(symlink_to_dir, "a directory"),
    "dangling-symlink": Bad(dangling_symlink, "cannot open"),
    "nonexistent-path": Bad(lambda tmp: tmp / "missing.safetensors", "cannot open"),
    "path-with-nul": Bad(lambda tmp: Path(f"{tmp}/a\0b"), "cannot open"),
    "fifo": Bad(fifo, "not a regular file"),
    "larger-than-max-file-bytes": Bad(raw_case(lambda r: r, None).make, "exceeds max_file_bytes",
                                      max_file_bytes=len(BASE_RAW) - 1),
}
_EXPECT_MATCH = {
    "expect-unknown-tensor": "unknown: ['extra']",
    "expect-missing-tensor": "missing: ['v']",
    "expect-wrong-dtype": "'k' dtype expected torch.float16, found torch.float32",
    "expect-wrong-shape": "'k' shape expected [2, 3, 4], found [2, 4, 3]",
    "expect-wrong-fingerprint": "'fingerprint' expected 'f00dfeed', found '0ther'",
    "expect-wrong-layer": "'layer' expected '3', found '4'",
    "expect-wrong-kind": "'kind' expected 'page', found 'saved-cache'",
    "expect-wrong-token-range": "'token_end' expected '48', found '49'",
    "expect-missing-meta-key": "'page_size' expected '16', found none",
}
for _name, _fragment in _EXPECT_MATCH.items():
    CATALOGUE[_name].match = _fragment


@pytest.mark.parametrize("case", CATALOGUE.values(), ids=CATALOGUE.keys())
def test_corrupted_file_is_rejected(tmp_path, case, figures):
    path = case.make(tmp_path)
    with pytest.raises(KVFileError) as info:
        read_kv_file(path, _check, max_file_bytes=case.max_file_bytes)
    msg = str(info.value)
    assert str(path) in msg, msg
    assert case.match is None or case.match in msg, msg
    figures.count("corrupted files rejected with KVFileError")


def test_catalogue_size():
    assert len(CATALOGUE) >= 25
    print(f"kvfile: {len(CATALOGUE)} corrupted files in the catalogue")


@pytest.mark.parametrize("name", ["header-len-2**63", "shape-huge-claims", "offsets-huge",
                                  "header-len-over-1MiB", "header-deeply-nested"])
def test_huge_claims_allocate_nothing_large(tmp_path, name):
    path = CATALOGUE[name].make(tmp_path)
    size = path.stat().st_size
    tracemalloc.start()
    try:
        with pytest.raises(KVFileError):
            read_kv_file(path, _check, max_file_bytes=MAX_BYTES)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= 4 * size + (1 << 20), (name, peak, size)


# -- fuzzing ----------------------------------------------------------------------------------

FUZZ_CASES = int(os.environ.get("TIERATTN_FUZZ_CASES", "2000"))
_ODD_VALUES = [None, True, False, 0, -1, 1.5, 2**31, 2**64, -(2**63), "", "x", "F16", "I8", [],
               [0], [1, 2], [2, 1], {}, {"a": "b"}, "\u00e9", [-1, 3]]


def _rand_value(rng: random.Random, old: object) -> object:
    if isinstance(old, int) and not isinstance(old, bool) and rng.random() < 0.6:
        return old + rng.choice([-8, -2, -1, 1, 2, 4, 8, 48])
    if isinstance(old, list) and old and rng.random() < 0.6:
        new = list(old)
        i = rng.randrange(len(new))
        new[i] = _rand_value(rng, new[i])
        return rng.choice([new, new[:-1], new + [rng.choice([0, 1, 2])], new[::-1]])
    if isinstance(old, str) and rng.random() < 0.5:
        return old[:-1] + chr(rng.randrange(32, 127)) if old else "y"
    return rng.choice(_ODD_VALUES)


def _edit_json(raw: bytes, rng: random.Random) -> tuple[bytes, str, bool]:
    header, data = split(raw)
    names = list(header)
    name = rng.choice(names)
    op = rng.choice(["field", "field", "field", "delete-field", "add-field", "delete-key",
                     "add-key", "rename-key", "swap-offsets"])
    target = header[name]
    if op == "field" and isinstance(target, dict) and target:
        k = rng.choice(list(target))
        target[k] = _rand_value(rng, target[k])
        what = f"{name}.{k}={target[k]!r}"
    elif op == "delete-field" and isinstance(target, dict) and target:
        k = rng.choice(list(target))
        del target[k]
        what = f"del {name}.{k}"
    elif op == "add-field" and isinstance(target, dict):
        target[rng.choice(["align", "dtype", "x", "checksum"])] = rng.choice(_ODD_VALUES)
        what = f"add field to {name}"
    elif op == "delete-key":
        del header[name]
        what = f"del {name}"
    elif op == "add-key":
        header[rng.choice(["__extra__", "extra", "k2"])] = rng.choice(
            [{"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}] + _ODD_VALUES)
        what = "add key"
    elif op == "rename-key":
        header[rng.choice(["K", "k ", "__x", "pos2"])] = header.pop(name)
        what = f"rename {name}"
    else:
        a, b = rng.sample([n for n in names if n != "__metadata__"], 2)
        header[a]["data_offsets"], header[b]["data_offsets"] = (header[b]["data_offsets"],
                                                                header[a]["data_offsets"])
        what = f"swap offsets {a} {b}"
    # sometimes fix the checksum so only the structure checks and `expect` stand in the way
    if rng.random() < 0.5 and isinstance(header.get("__metadata__"), dict):
        try:
            header["__metadata__"]["checksum"] = checksum(header, data)
            what += " (re-checksummed)"
        except (TypeError, ValueError, AttributeError):
            pass
    forged = what.endswith("(re-checksummed)")
    return join(header, data, pad=rng.random() < 0.8), f"json edit: {what}", forged


def _mutate(raw: bytes, rng: random.Random) -> tuple[bytes, str, bool]:
    """One seeded mutation of ``raw``: the new bytes, what was done, and whether the checksum was
    recomputed (a forged but well-formed file may legitimately hold other tensors)."""
    kind = rng.choice(["bit-flips", "overwrite", "truncate", "insert", "delete", "header-len",
                       "json", "json", "json"])
    b = bytearray(raw)
    n = int.from_bytes(raw[:8], "little")
    header_only = rng.random() < 0.5  # aim half of the byte edits at the header
    lo, hi = (0, 8 + n) if header_only else (0, len(b))
    if kind == "bit-flips":
        spots = [(rng.randrange(lo, hi), rng.randrange(8)) for _ in range(rng.randint(1, 4))]
        for pos, bit in spots:
            b[pos] ^= 1 << bit
        return bytes(b), f"bit flips {spots}", False
    if kind == "overwrite":
        pos = rng.randrange(lo, hi)
        new = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        b[pos:pos + len(new)] = new
        return bytes(b)[:len(raw)], f"overwrite at {pos} with {new!r}", False
    if kind == "truncate":
        at = rng.randrange(len(b))
        return bytes(b[:at]), f"truncate to {at}", False
    if kind == "insert":
        pos = rng.randrange(lo, hi + 1)
        new = bytes(rng.choice([0, 32, 123, 125, 34, rng.randrange(256)])
                    for _ in range(rng.randint(1, 16)))
        b[pos:pos] = new
        return bytes(b), f"insert {new!r} at {pos}", False
    if kind == "delete":
        pos = rng.randrange(lo, hi)
        k = rng.randint(1, 16)
        del b[pos:pos + k]
        return bytes(b), f"delete {k} bytes at {pos}", False
    if kind == "header-len":
        new_n = rng.choice([0, 1, 2, n - 1, n + 1, n - 8, n + 8, len(raw) - 8, len(raw),
                            2**32 + n, 2**63, 2**64 - 1, rng.randrange(2**64)])
        b[:8] = new_n.to_bytes(8, "little")
        return bytes(b), f"header length {n} -> {new_n}", False
    return _edit_json(raw, rng)


def test_fuzzed_files_are_rejected_or_read_exactly(tmp_path, monkeypatch, seed, figures):
    path = tmp_path / "fuzz.safetensors"
    max_bytes = len(BASE_RAW) + 64
    real = kvfile._buffer
    current = [0]

    def bounded(n: int) -> bytearray:
        if n > current[0]:
            raise AssertionError(f"allocation of {n} bytes for a {current[0]}-byte file")
        return real(n)

    monkeypatch.setattr(kvfile, "_buffer", bounded)
    outcomes = {"rejected": 0, "accepted": 0}
    failures = []
    for i in range(FUZZ_CASES):
        case_seed = seed + i
        data, what, forged = _mutate(BASE_RAW, random.Random(case_seed))
        path.write_bytes(data)
        current[0] = len(data)
        try:
            got = read_kv_file(path, _check, max_file_bytes=max_bytes)
        except KVFileError as e:
            outcomes["rejected"] += 1
            if str(path) not in str(e):
                failures.append(f"seed {case_seed} ({what}): message lacks the path: {e}")
            continue
        except BaseException as e:  # anything else is a bug
            failures.append(f"seed {case_seed} ({what}): {type(e).__name__}: {e}")
            continue
        outcomes["accepted"] += 1
        try:  # a forged file must read as what it says; any other file as the original
            assert_bitwise_equal(got, decode(data) if forged else BASE)
        except Exception as e:
            failures.append(f"seed {case_seed} ({what}): accepted but read wrongly: {e!r}")
    print(f"kvfile fuzz: {FUZZ_CASES} mutations (seeds {seed}..{seed + FUZZ_CASES - 1}): "
          f"{outcomes['rejected']} rejected, {outcomes['accepted']} read back exactly")
    assert not failures, f"{len(failures)} fuzz failures:\n" + "\n".join(failures[:20])
    assert outcomes["rejected"] > FUZZ_CASES * 0.8  # the mutations do reach the checks
    figures.count("fuzzed KV files rejected", outcomes["rejected"])
    figures.count("fuzzed KV files still valid and read back exactly", outcomes["accepted"])

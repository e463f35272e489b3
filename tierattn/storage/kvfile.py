"""The one on-disk format of tierattn: disk-tier pages and saved caches.

A file is a safetensors file (8-byte little-endian header length ``N``, ``N`` bytes of JSON
header, then the data region), written and read by this module alone:

- Writing is atomic: a temp file in the target directory, flush + fsync, ``os.replace`` onto a
  digest-derived name, fsync of the directory. An existing file is never modified in place.
  Temp files are named ``.<final name>.<random>.tmp``; one left behind by a killed process is
  never read and may be deleted.
- Reading checks the whole structure from the header bytes and the file size before it
  allocates anything sized by the file, hands the header to the caller's ``check`` (shapes come
  from the caller's config, never from the file alone), then reads the data into private
  buffers, verifies the checksum and builds CPU tensors that own their memory (no mapping).
- Every bad file raises :class:`~tierattn.errors.KVFileError` naming the file and the fault.

The ``checksum`` metadata field is the SHA-256 (hex) of the canonical header without the
checksum (compact, sorted-key JSON of the metadata and the tensor entries) followed by the data
region, so a damaged header is caught as surely as damaged data. Tensors are stored contiguous
and little-endian, ordered by item size (largest first) then name, so every tensor is aligned to
its item size (as safetensors itself does); other safetensors readers can load the files.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from tierattn.errors import KVFileError

__all__ = [
    "DTYPES", "FORMAT_VERSION", "MAX_HEADER_BYTES", "MAX_RANK", "KVHeader", "TensorEntry",
    "expect", "kv_file_name", "read_kv_file", "read_kv_header", "write_kv_file",
]

FORMAT_VERSION: int = 1

#: the dtypes a KV file may hold, by safetensors name; anything else is rejected.
DTYPES: dict[str, torch.dtype] = {
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I32": torch.int32,
    "I64": torch.int64,
    "U8": torch.uint8,
}
_CODES = {dtype: code for code, dtype in DTYPES.items()}

#: largest JSON header accepted (and written).
MAX_HEADER_BYTES = 1 << 20
#: largest tensor rank accepted (and written).
MAX_RANK = 8

_METADATA = "__metadata__"
_RESERVED_META = ("format_version", "checksum")
_ENTRY_KEYS = frozenset({"dtype", "shape", "data_offsets"})
# 2**64 has 20 digits: longer integer literals are rejected before Python converts them
_MAX_INT_DIGITS = 20
_READ_CHUNK = 1 << 24


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a KV file; ``start``/``end`` are byte offsets in the data region."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class KVHeader:
    """The validated header of a KV file (structure checked; checksum not yet verified).

    ``meta`` holds the ``__metadata__`` strings, ``format_version`` and ``checksum`` included;
    ``tensors`` is ordered by offset. ``size`` is the file size and ``data_start`` the offset of
    the data region in the file (``8 + N``).
    """

    path: Path
    meta: dict[str, str]
    tensors: dict[str, TensorEntry]
    size: int
    data_start: int


def kv_file_name(key: str) -> str:
    """The file name for ``key``: 32 hex digits of SHA-256(key) plus ``.safetensors``.

    No text of the key reaches the file system, so a key such as ``"../../etc/passwd"`` names
    a plain file inside the directory it is written to.
    """
    if not isinstance(key, str):
        raise TypeError(f"kv_file_name: key must be a str, got {type(key).__name__}")
    digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()
    return digest[:32] + ".safetensors"


def write_kv_file(directory: str | os.PathLike[str], key: str,
                  tensors: Mapping[str, torch.Tensor], meta: Mapping[str, str]) -> Path:
    """Write ``tensors`` and ``meta`` atomically to ``directory / kv_file_name(key)``.

    Args:
        directory: an existing directory; the temp file is created in it, so the final rename
            never crosses file systems.
        key: any string; only its digest names the file.
        tensors: name -> tensor (any device, any strides); names are non-empty, do not start
            with ``"__"``; dtypes are in :data:`DTYPES`; rank at most :data:`MAX_RANK`.
        meta: str -> str metadata (e.g. kind, fingerprint, page_size, layer, token_start,
            token_end); ``format_version`` and ``checksum`` are added here and are reserved.

    Returns:
        The path of the written file.

    Raises:
        KVFileError: a tensor, name or metadata entry cannot be stored (nothing is written).
        OSError: the file system failed (e.g. disk full); the temp file is removed and an
            existing file of that name is left as it was.
    """
    directory = Path(directory)
    final = directory / kv_file_name(key)
    order, arrays = _prepare(final, tensors)
    header, canonical = _header_for_write(final, meta, order)

    digest = hashlib.sha256(canonical)
    for arr in arrays:
        digest.update(arr)
    header[_METADATA]["checksum"] = digest.hexdigest()
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    text += b" " * (-len(text) % 8)  # pad so the data region starts 8-byte aligned
    if len(text) > MAX_HEADER_BYTES:
        raise KVFileError(f"cannot write KV file {final}: header is {len(text)} bytes, more "
                          f"than MAX_HEADER_BYTES={MAX_HEADER_BYTES}; store fewer tensors")

    fd, tmp_name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=directory)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(len(text).to_bytes(8, "little"))
            f.write(text)
            for arr in arrays:
                f.write(arr)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    _fsync_directory(directory)
    return final


def read_kv_header(path: str | os.PathLike[str], *, max_file_bytes: int) -> KVHeader:
    """Validate a KV file's structure from its header bytes and size alone; read no data.

    Checks: a regular file (symlinks followed) of at most ``max_file_bytes`` bytes and at least
    8; header length in ``[2, min(MAX_HEADER_BYTES, size - 8)]``; header is a UTF-8 JSON object
    without duplicate keys; ``__metadata__`` is a str -> str dict with ``format_version ==
    FORMAT_VERSION`` and a SHA-256 hex ``checksum``; no other ``"__"`` key; every tensor entry
    has exactly ``dtype``/``shape``/``data_offsets``, the dtype in :data:`DTYPES`, the shape a
    list of at most :data:`MAX_RANK` non-negative ints whose nonzero product times the item size
    is below 2**63, ``0 <= start <= end`` with ``end -
    start == prod(shape) * itemsize``; the entries, sorted by offset, tile the data region
    exactly (no overlap, no gap, no trailing bytes).

    The metadata is not yet covered by the checksum: :func:`read_kv_file` verifies it.

    Raises:
        KVFileError: naming the file and the first fault found.
    """
    path = _check_path_arg(path, max_file_bytes)
    with _open_regular(path) as (f, size):
        return _read_header(f, path, size, max_file_bytes)


def read_kv_file(path: str | os.PathLike[str], check: Callable[[KVHeader], None], *,
                 max_file_bytes: int) -> dict[str, torch.Tensor]:
    """Read a KV file: validate the header, let ``check`` vet it, then load and verify the data.

    Args:
        path: the file.
        check: called with the validated :class:`KVHeader` before any data is read; it compares
            names, dtypes, shapes and metadata with what the caller's config expects and raises
            :class:`KVFileError` on a mismatch (usually ``lambda h: expect(h, meta=...,
            tensors=...)``). Any exception it raises propagates unchanged.
        max_file_bytes: files larger than this are rejected before anything is read.

    Returns:
        name -> CPU tensor, each owning a private copy of its bytes, in offset order.

    Raises:
        KVFileError: the file is missing, unreadable, malformed, rejected by ``check``, or its
            checksum does not match; nothing is returned.
    """
    path = _check_path_arg(path, max_file_bytes)
    with _open_regular(path) as (f, size):
        header = _read_header(f, path, size, max_file_bytes)
        # what is read and verified is fixed before `check` sees (and could alter) the header
        entries, expected = list(header.tensors.values()), header.meta["checksum"]
        digest = hashlib.sha256(_canonical(header.meta, entries))
        check(header)
        buffers = []
        try:
            # the entries tile the data region in this order, so reading them in turn reads it all
            for entry in entries:
                buf = _buffer(entry.end - entry.start)
                _read_exact(f, buf, path, f"data of tensor {entry.name!r}")
                digest.update(buf)
                buffers.append(buf)
            extra = f.read(1)
        except OSError as e:
            raise KVFileError(f"KV file {path}: read failed: {e}") from e
        if extra:
            raise KVFileError(f"KV file {path}: file grew while it was read")
    if digest.hexdigest() != expected:
        raise KVFileError(f"KV file {path}: checksum mismatch (expected {expected}, found "
                          f"{digest.hexdigest()}): the header or data is damaged")
    out = {}
    for entry, buf in zip(entries, buffers):
        try:
            if len(buf) == 0:
                out[entry.name] = torch.zeros(entry.shape, dtype=entry.dtype)
            else:
                out[entry.name] = torch.frombuffer(buf, dtype=entry.dtype).reshape(entry.shape)
        except (RuntimeError, TypeError, ValueError) as e:
            raise KVFileError(f"KV file {path}: tensor {entry.name!r} with shape "
                              f"{list(entry.shape)} cannot be built: {e}") from e
    return out


def expect(header: KVHeader, *, meta: Mapping[str, str],
           tensors: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]) -> None:
    """Check that ``header`` holds exactly ``tensors`` and carries ``meta``.

    Args:
        header: from :func:`read_kv_header` or the ``check`` hook of :func:`read_kv_file`.
        meta: key -> expected string value (e.g. kind, fingerprint, page_size, layer,
            token_start, token_end); keys not listed here are not compared.
        tensors: name -> (dtype, shape): the file must hold exactly these names, each with
            this dtype and shape.

    Raises:
        KVFileError: naming the file, the field, the expected and the found value.
        TypeError: an expected ``meta`` value is not a str (a caller bug).
    """
    where = f"KV file {header.path}"
    found_names, want_names = set(header.tensors), set(tensors)
    if found_names != want_names:
        raise KVFileError(f"{where}: tensor names expected {sorted(want_names)}, found "
                          f"{sorted(found_names)} (unknown: {sorted(found_names - want_names)}, "
                          f"missing: {sorted(want_names - found_names)})")
    for name, (dtype, shape) in tensors.items():
        entry = header.tensors[name]
        if entry.dtype != dtype:
            raise KVFileError(f"{where}: tensor {name!r} dtype expected {dtype}, found "
                              f"{entry.dtype}")
        if entry.shape != tuple(shape):
            raise KVFileError(f"{where}: tensor {name!r} shape expected {list(shape)}, found "
                              f"{list(entry.shape)}")
    for key, value in meta.items():
        if not isinstance(value, str):
            raise TypeError(f"expect: meta[{key!r}] must be a str, got {type(value).__name__}")
        if key not in header.meta:
            raise KVFileError(f"{where}: metadata {key!r} expected {value!r}, found none")
        if header.meta[key] != value:
            raise KVFileError(f"{where}: metadata {key!r} expected {value!r}, found "
                              f"{header.meta[key]!r}")


# -- writing helpers ---------------------------------------------------------------------------

def _prepare(final: Path, tensors: Mapping[str, torch.Tensor]) -> tuple[list[TensorEntry], list]:
    where = f"cannot write KV file {final}"
    if not isinstance(tensors, Mapping):
        raise KVFileError(f"{where}: tensors must be a mapping name -> tensor")
    items = []
    for name, t in tensors.items():
        _check_name(name, where)
        if not isinstance(t, torch.Tensor):
            raise KVFileError(f"{where}: tensors[{name!r}] is a {type(t).__name__}, not a tensor")
        if t.dtype not in _CODES:
            raise KVFileError(f"{where}: tensor {name!r} has dtype {t.dtype}; allowed: "
                              f"{', '.join(str(d) for d in DTYPES.values())}")
        if t.dim() > MAX_RANK:
            raise KVFileError(f"{where}: tensor {name!r} has rank {t.dim()}, more than "
                              f"MAX_RANK={MAX_RANK}")
        if t.layout != torch.strided or t.device.type == "meta":
            raise KVFileError(f"{where}: tensor {name!r} must be a dense tensor with data "
                              f"(layout {t.layout}, device {t.device})")
        items.append((name, t))
    items.sort(key=lambda it: (-it[1].dtype.itemsize, it[0]))
    order, arrays, offset = [], [], 0
    for name, t in items:
        flat = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        arr = flat.numpy()
        order.append(TensorEntry(name, t.dtype, tuple(t.shape), offset, offset + arr.nbytes))
        arrays.append(memoryview(arr))
        offset += arr.nbytes
    return order, arrays


def _header_for_write(final: Path, meta: Mapping[str, str],
                      order: list[TensorEntry]) -> tuple[dict, bytes]:
    where = f"cannot write KV file {final}"
    if not isinstance(meta, Mapping):
        raise KVFileError(f"{where}: meta must be a mapping str -> str")
    full = {"format_version": str(FORMAT_VERSION)}
    for k, v in meta.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise KVFileError(f"{where}: meta must map str -> str, got {k!r}: {v!r}")
        if k in _RESERVED_META:
            raise KVFileError(f"{where}: meta key {k!r} is reserved (written by write_kv_file)")
        for s in (k, v):
            _check_utf8(s, where)
        full[k] = v
    header: dict[str, Any] = {_METADATA: full}
    for e in order:
        header[e.name] = {"dtype": _CODES[e.dtype], "shape": list(e.shape),
                          "data_offsets": [e.start, e.end]}
    return header, _canonical(full, order)


def _check_name(name: object, where: str) -> None:
    if not isinstance(name, str) or not name or name.startswith("__"):
        raise KVFileError(f"{where}: tensor name {name!r} must be a non-empty str not starting "
                          f"with '__'")
    _check_utf8(name, where)


def _check_utf8(s: str, where: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise KVFileError(f"{where}: {s!r} is not valid UTF-8 text") from e


def _canonical(meta: Mapping[str, str], entries) -> bytes:
    """The bytes the checksum covers before the data: the header without the checksum."""
    obj: dict[str, Any] = {_METADATA: {k: v for k, v in meta.items() if k != "checksum"}}
    for e in entries:
        obj[e.name] = {"dtype": _CODES[e.dtype], "shape": list(e.shape),
                       "data_offsets": [e.start, e.end]}
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _fsync_directory(directory: Path) -> None:
    if os.name == "nt":  # directories cannot be opened for fsync on Windows
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- reading helpers ---------------------------------------------------------------------------

def _buffer(n: int) -> bytearray:
    """Every buffer the reader allocates comes from here (tests bound ``n`` by the file size)."""
    return bytearray(n)


def _check_path_arg(path: str | os.PathLike[str], max_file_bytes: int) -> Path:
    if isinstance(max_file_bytes, bool) or not isinstance(max_file_bytes, int) \
            or max_file_bytes < 8:
        raise ValueError(f"max_file_bytes must be an int >= 8, got {max_file_bytes!r}")
    try:
        return Path(path)
    except TypeError as e:
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}") from e


@contextmanager
def _open_regular(path: Path) -> Iterator[tuple[BinaryIO, int]]:
    """Open ``path`` for reading and yield ``(file, size)`` if it is a regular file."""
    flags = os.O_RDONLY | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0)
    flags |= getattr(os, "O_NONBLOCK", 0)  # opening a FIFO must not block
    try:
        fd = os.open(path, flags)
    except (OSError, ValueError) as e:  # ValueError: an embedded NUL in the path
        raise KVFileError(f"KV file {path}: cannot open: {getattr(e, 'strerror', None) or e}") \
            from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
            raise KVFileError(f"KV file {path}: is {kind}")
        f = os.fdopen(fd, "rb", buffering=0)
    except OSError as e:
        os.close(fd)
        raise KVFileError(f"KV file {path}: cannot stat: {e.strerror or e}") from e
    except BaseException:
        os.close(fd)
        raise
    with f:
        yield f, st.st_size


def _read_exact(f, buf: bytearray, path: Path, what: str) -> None:
    view, got = memoryview(buf), 0
    while got < len(buf):
        n = f.readinto(view[got:got + _READ_CHUNK])
        if not n:
            raise KVFileError(f"KV file {path}: truncated while reading {what} (got {got} of "
                              f"{len(buf)} bytes; the file changed while it was read)")
        got += n


def _reject_constant(s: str) -> None:
    raise ValueError(f"{s} is not allowed")


def _parse_int(s: str) -> int:
    if len(s.lstrip("-")) > _MAX_INT_DIGITS:
        raise ValueError(f"integer literal of {len(s)} characters")
    return int(s)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _read_header(f, path: Path, size: int, max_file_bytes: int) -> KVHeader:
    where = f"KV file {path}"
    if size > max_file_bytes:
        raise KVFileError(f"{where}: size {size} bytes exceeds max_file_bytes={max_file_bytes}")
    if size < 8:
        raise KVFileError(f"{where}: {size} bytes, too short for the 8-byte header length")
    try:
        prefix = _buffer(8)
        _read_exact(f, prefix, path, "the header length")
        n = int.from_bytes(prefix, "little")
        if n < 2 or n > min(MAX_HEADER_BYTES, size - 8):
            raise KVFileError(f"{where}: header length {n} is not in [2, min(MAX_HEADER_BYTES="
                              f"{MAX_HEADER_BYTES}, file size - 8 = {size - 8})]")
        raw = _buffer(n)
        _read_exact(f, raw, path, "the header")
    except OSError as e:
        raise KVFileError(f"{where}: read failed: {e}") from e
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise KVFileError(f"{where}: header is not UTF-8 ({e.reason} at byte {e.start})") from e
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicates, parse_int=_parse_int,
                         parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise KVFileError(f"{where}: header is not valid JSON: {str(e)[:200]}") from e
    if not isinstance(obj, dict):
        raise KVFileError(f"{where}: header is a JSON {type(obj).__name__}, not an object")

    meta = obj.pop(_METADATA, None)
    if not isinstance(meta, dict):
        raise KVFileError(f"{where}: header field {_METADATA!r} must be an object, found "
                          f"{type(meta).__name__}")
    for k, v in meta.items():
        if not isinstance(v, str):
            raise KVFileError(f"{where}: metadata {k!r} must be a string, found "
                              f"{type(v).__name__}")
        for s in (k, v):
            try:
                s.encode("utf-8")
            except UnicodeEncodeError as e:
                raise KVFileError(f"{where}: metadata {k!r} is not valid UTF-8 text") from e
    if meta.get("format_version") != str(FORMAT_VERSION):
        raise KVFileError(f"{where}: metadata 'format_version' expected "
                          f"{str(FORMAT_VERSION)!r}, found {meta.get('format_version')!r}")
    checksum = meta.get("checksum")
    if not (isinstance(checksum, str) and len(checksum) == 64
            and all(c in "0123456789abcdef" for c in checksum)):
        raise KVFileError(f"{where}: metadata 'checksum' must be 64 lowercase hex digits, found "
                          f"{checksum!r}")

    entries = [_entry(name, spec, where) for name, spec in obj.items()]
    entries.sort(key=lambda e: (e.start, e.end, e.name))
    data_start, data_len, cursor = 8 + n, size - 8 - n, 0
    for e in entries:
        if e.start != cursor:
            kind = "overlaps the previous tensor" if e.start < cursor else "leaves a gap"
            raise KVFileError(f"{where}: tensor {e.name!r} at data offsets [{e.start}, {e.end}] "
                              f"{kind} (expected start {cursor})")
        if e.end > data_len:
            raise KVFileError(f"{where}: tensor {e.name!r} ends at data offset {e.end}, past the "
                              f"data region of {data_len} bytes (file truncated?)")
        cursor = e.end
    if cursor != data_len:
        raise KVFileError(f"{where}: data region is {data_len} bytes but the tensors cover "
                          f"{cursor} ({data_len - cursor} trailing bytes)")
    return KVHeader(path=path, meta=meta, tensors={e.name: e for e in entries}, size=size,
                    data_start=data_start)


def _entry(name: str, spec: object, where: str) -> TensorEntry:
    if not name or name.startswith("__"):
        raise KVFileError(f"{where}: unknown top-level header key {name!r}")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as e:
        raise KVFileError(f"{where}: tensor name {name!r} is not valid UTF-8 text") from e
    at = f"{where}: tensor {name!r}"
    if not isinstance(spec, dict) or set(spec) != _ENTRY_KEYS:
        found = sorted(spec) if isinstance(spec, dict) else type(spec).__name__
        raise KVFileError(f"{at}: entry must have exactly {sorted(_ENTRY_KEYS)}, found {found}")
    code = spec["dtype"]
    if not isinstance(code, str) or code not in DTYPES:
        raise KVFileError(f"{at}: dtype {code!r} is not allowed (allowed: {sorted(DTYPES)})")
    shape = spec["shape"]
    if not isinstance(shape, list) or len(shape) > MAX_RANK or not all(
            type(d) is int and d >= 0 for d in shape):
        raise KVFileError(f"{at}: shape must be a list of at most {MAX_RANK} non-negative "
                          f"ints, found {str(shape)[:100]}")
    offsets = spec["data_offsets"]
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(type(o) is int for o in offsets) and 0 <= offsets[0] <= offsets[1]):
        raise KVFileError(f"{at}: data_offsets must be two ints 0 <= start <= end, found "
                          f"{str(offsets)[:100]}")
    dtype = DTYPES[code]
    if math.prod(max(d, 1) for d in shape) * dtype.itemsize >= 2**63:  # torch strides are int64
        raise KVFileError(f"{at}: shape {shape} is too large for a tensor")
    nbytes = math.prod(shape) * dtype.itemsize
    if offsets[1] - offsets[0] != nbytes:
        raise KVFileError(f"{at}: shape {shape} x {code} is {nbytes} bytes but data_offsets "
                          f"{offsets} span {offsets[1] - offsets[0]}")
    return TensorEntry(name, dtype, tuple(shape), offsets[0], offsets[1])

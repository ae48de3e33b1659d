"""The streamed replay's index of a recording: every step file checked and described, its
sampled gradient values left in the file.

:func:`scan` reads each step file once, with the same checks and errors as the whole
load (:func:`parity_tests.audit_files.read_rank_file`), keeps its metadata, router
buffers and ``has_grad`` flags, and notes where its ``grads_before`` / ``grads_after``
members lie in the file (an uncompressed ``.npz`` is a stored ZIP: each member's ``.npy``
data is a plain byte range). The replay then reads any range of samples of one rank
with one ``seek`` and ``read``. What the ranks of one recording share (a plan's parameter
list, its sampled positions, group member lists, the config) is held once, so the index
of a rank costs a few kilobytes whatever the number of parameters.
"""

from __future__ import annotations

import dataclasses
import struct
import zipfile
from typing import Any

import numpy as np

from parity_tests.audit_files import AuditError, RankFile, collect, read_rank_file

#: A ZIP local file header: signature, then fixed fields; name and extra lengths at 26.
_LOCAL_HEADER = 30
_LOCAL_MAGIC = b"PK\x03\x04"


@dataclasses.dataclass
class Values:
    """Where one rank's sampled gradient values are (``grads_before`` or ``grads_after``).

    Args:
      offset: byte offset of element 0 in the file, or -1 when ``loaded`` holds them.
      dtype: the stored dtype.
      loaded: the values (float64), for a member that is not stored plainly (compressed).
    """

    offset: int
    dtype: np.dtype
    loaded: np.ndarray | None = None

    def read(self, handle: Any, lo: int, hi: int) -> np.ndarray:
        """Elements ``[lo, hi)`` as float64.

        Args:
          handle: the file, open for binary reading (unused when loaded).
          lo, hi: the element range.

        Returns:
          A new float64 array of ``hi - lo`` values.
        """
        if self.loaded is not None:
            return np.array(self.loaded[lo:hi], np.float64)
        size = self.dtype.itemsize
        handle.seek(self.offset + lo * size)
        raw = handle.read((hi - lo) * size)
        if len(raw) != (hi - lo) * size:
            raise OSError(f"{getattr(handle, 'name', 'file')}: truncated (elements {lo}..{hi})")
        return np.frombuffer(raw, self.dtype).astype(np.float64)


@dataclasses.dataclass
class RankIndex(RankFile):
    """One rank's record of one step without its gradient values.

    ``meta`` is a :class:`RankFile`'s, except that ``meta["params"]`` is the plan's list,
    shared by the ranks of one plan (no per-parameter ``has_grad``); ``arrays`` holds
    ``positions`` (shared) and the router buffers.

    Args:
      has_grad: ``[2, params]`` bool, whether each parameter had a gradient before / after.
      before, after: where the sampled values are.
    """

    has_grad: np.ndarray
    before: Values
    after: Values

    def read(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """The "before" and "after" values of samples ``[lo, hi)``, float64.

        Raises:
          AuditError: the file cannot be read again (removed or cut since it was indexed).
        """
        if self.before.loaded is not None and self.after.loaded is not None:
            return self.before.read(None, lo, hi), self.after.read(None, lo, hi)
        try:
            with open(self.path, "rb") as handle:
                return self.before.read(handle, lo, hi), self.after.read(handle, lo, hi)
        except OSError as err:
            raise AuditError(f"{self.path}: cannot be read again during the replay ({err}); do not change "
                             "the files while they are replayed") from None


class _Shared:
    """One object for equal plan facts of different ranks (one scan's tables)."""

    #: Values kept per kind and length to compare a new one with (the most recent first).
    CANDIDATES = 8

    def __init__(self) -> None:
        self._values: dict[tuple[str, int], list[Any]] = {}
        self._groups: dict[tuple[int, ...], list[int]] = {}
        self._arrays: dict[tuple[str, tuple[int, ...]], list[np.ndarray]] = {}

    def value(self, obj: Any) -> Any:
        """An equal JSON value seen before, else ``obj`` (remembered among the last few of its kind)."""
        seen = self._values.setdefault((type(obj).__name__, len(obj) if hasattr(obj, "__len__") else 0), [])
        for other in seen:
            if other == obj:
                return other
        seen.insert(0, obj)
        del seen[self.CANDIDATES:]
        return obj

    def group(self, members: list[int]) -> list[int]:
        """The first equal member list seen."""
        return self._groups.setdefault(tuple(members), members)

    def array(self, array: np.ndarray) -> np.ndarray:
        """An equal array seen before, else ``array`` (read-only; remembered among the last few)."""
        seen = self._arrays.setdefault((array.dtype.str, array.shape), [])
        for other in seen:
            if np.array_equal(other, array):
                return other
        array.setflags(write=False)
        seen.insert(0, array)
        del seen[self.CANDIDATES:]
        return array

    def plan(self, static: dict[str, Any]) -> dict[str, Any]:
        """A plan's static facts with their parts shared."""
        out = dict(static)
        for key in ("params", "config", "routers", "router_fields", "ddp_chunks"):
            if key in out:
                out[key] = self.value(out[key])
        if isinstance(out.get("layout"), dict) and isinstance(out["layout"].get("members"), dict):
            layout = dict(out["layout"])
            layout["members"] = {g: self.group(m) for g, m in layout["members"].items()}
            out["layout"] = layout
        return out


def _members(path: str) -> dict[str, tuple[int, tuple[int, ...], np.dtype]]:
    """Each plainly stored ``.npy`` member of an ``.npz``: (data offset, shape, dtype).

    Compressed or Fortran-ordered members, and members whose size does not match their
    header, are left out (the caller keeps their values in memory).
    """
    out = {}
    with zipfile.ZipFile(path) as archive, open(path, "rb") as raw:
        for info in archive.infolist():
            if info.compress_type != zipfile.ZIP_STORED or not info.filename.endswith(".npy"):
                continue
            raw.seek(info.header_offset)
            head = raw.read(_LOCAL_HEADER)
            if len(head) != _LOCAL_HEADER or head[:4] != _LOCAL_MAGIC:
                continue
            name_len, extra_len = struct.unpack("<HH", head[26:30])
            start = info.header_offset + _LOCAL_HEADER + name_len + extra_len
            raw.seek(start)
            version = np.lib.format.read_magic(raw)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(raw)
            elif version == (2, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(raw)
            else:
                continue
            data = raw.tell()
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            if fortran or dtype.hasobject or data - start + nbytes != info.file_size:
                continue
            out[info.filename[:-4]] = (data, tuple(shape), dtype)
    return out


class Indexer:
    """Reads step files into :class:`RankIndex` records (a :func:`collect` reader).

    Every file is read whole once, by :func:`read_rank_file` (so a damaged file raises
    the same error as in the whole load), then only its metadata is kept.
    """

    def __init__(self) -> None:
        self._shared = _Shared()
        self._interned: set[tuple[int, str]] = set()

    def __call__(self, directory: str, path: str, step: int, rank: int, plans: dict[Any, Any]) -> RankIndex:
        """One step file's index (``plans``: the plan cache of :func:`read_rank_file`)."""
        full = read_rank_file(directory, path, step, rank, plans)
        key = (rank, str(full.meta["plan"]))
        raw_static = plans[key][0]
        if key not in self._interned:
            plans[key] = (self._shared.plan(raw_static), self._shared.array(plans[key][1]))
            self._interned.add(key)
        static, positions = plans[key]
        meta = {k: (static[k] if k in raw_static and v is raw_static[k] else v)
                for k, v in full.meta.items() if k != "params"}
        meta["params"] = static["params"]
        params = full.meta["params"]
        has = np.array([[p["has_grad"] for p in params], [p["has_grad_after"] for p in params]], dtype=bool)
        arrays = {k: v for k, v in full.arrays.items() if k.startswith("router")}
        arrays["positions"] = positions
        try:
            stored = _members(path)
        except (OSError, ValueError, zipfile.BadZipFile):  # read whole just before: keep its values instead
            stored = {}
        values = []
        for name in ("grads_before", "grads_after"):
            where = stored.get(name)
            if where is not None and where[1] == (positions.size,) and where[2].kind in "fiub":
                values.append(Values(where[0], where[2]))
            else:
                values.append(Values(-1, np.dtype(np.float64), full.arrays[name.replace("grads", "grad")]))
        return RankIndex(path, meta, arrays, self._shared.array(has), values[0], values[1])


def scan(directory: str) -> dict[int, list[RankIndex]]:
    """Every step of ``directory``, per step its ranks' indexes by rank.

    Raises:
      AuditError: as :func:`parity_tests.audit_files.load`.
    """
    return collect(directory, Indexer())  # type: ignore[return-value]

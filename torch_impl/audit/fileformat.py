"""The audit's file format: file names and portable, uncompressed ``.npz`` files written
atomically (plain numpy: ``np.load(path, allow_pickle=False)`` reads every file)."""

from __future__ import annotations

import os
import struct
import zlib

import numpy as np

#: Version of the file layout written here (parity_tests.audit checks it).
FORMAT_VERSION = 2
#: Router buffers recorded whole.
ROUTER_FIELDS = ("local_tokens_per_expert", "expert_bias", "qb_beta", "qb_beta_accum", "qb_beta_count")


def file_name(step: int, rank: int) -> str:
    """The file one rank writes for one step."""
    return f"step{step:08d}.rank{rank:05d}.npz"


def plan_file_name(rank: int, plan: str) -> str:
    """The file one rank writes once per plan (what its step files share)."""
    return f"plan.rank{rank:05d}.{plan}.npz"


def _npy(array: np.ndarray) -> bytes:
    """One array in the ``.npy`` format, version 1.0 (what ``np.load`` reads)."""
    array = np.asarray(array, order="C")
    header = "{'descr': %r, 'fortran_order': False, 'shape': %r, }" % (
        np.lib.format.dtype_to_descr(array.dtype), tuple(array.shape))
    pad = 64 - (10 + len(header) + 1) % 64
    header = (header + " " * pad + "\n").encode("latin1")
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header + array.tobytes()


def npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    """An uncompressed ``.npz`` (a stored ZIP of ``.npy`` members), built in one pass:
    ``np.load(..., allow_pickle=False)`` reads it like ``np.savez``'s."""
    local: list[bytes] = []
    central: list[bytes] = []
    offset = 0
    for key, array in arrays.items():
        name = f"{key}.npy".encode()
        data = _npy(array)
        crc = zlib.crc32(data)
        head = struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 0, 0, 0x21, crc, len(data), len(data), len(name), 0)
        local += (head, name, data)
        central.append(struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, 0, 0, 0x21, crc, len(data), len(data),
                                   len(name), 0, 0, 0, 0, 0o644 << 16, offset) + name)
        offset += len(head) + len(name) + len(data)
    directory = b"".join(central)
    end = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(central), len(central), len(directory), offset, 0)
    return b"".join(local) + directory + end


def _save(path: str, arrays: dict[str, np.ndarray]) -> None:
    """Write ``arrays`` as ``path`` (.npz), atomically (a temporary name, then renamed)."""
    data = npz_bytes(arrays)
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)
    os.replace(tmp, path)



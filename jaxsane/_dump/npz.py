"""Reading a dump's two files safely: only regular files are opened (no symlink, FIFO or device; never
blocks), the ``arrays.npz`` zip directory and each ``.npy`` header are checked (sizes, no object dtypes)
before anything is inflated, and nothing is ever unpickled. Every defect is a :class:`jaxsane.DumpError`.
Host-side only, not jit-safe.
"""

from __future__ import annotations

import math
import os
import re
import stat
import struct
import zipfile
from typing import IO, cast

import numpy as np

from .._core.errors import DumpError


def open_regular(file: str, what: str) -> IO[bytes]:
    """Open ``file`` for reading only if it is a regular file (no symlink, FIFO or device; never blocks)."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        st = os.lstat(file)
    except FileNotFoundError:
        raise DumpError(
            f"{os.path.dirname(file)!r} is not a jaxsane dump: {what} is missing. A dump directory "
            "holds tree.json and arrays.npz; point at the directory a guarded step printed in its "
            "NonFiniteError."
        ) from None
    except OSError as e:
        raise DumpError(f"cannot read {file}: {e.strerror or e}.") from e
    if not stat.S_ISREG(st.st_mode):
        kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a regular file"
        raise DumpError(
            f"{file} is {kind}; a dump is read only from regular files. Copy the real file into "
            "the dump directory if you trust it."
        )
    try:
        fd = os.open(file, flags)
    except OSError as e:
        raise DumpError(f"cannot open {file}: {e.strerror or e} (a dump is read only from regular files).") from e
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped between lstat and open
        os.close(fd)
        raise DumpError(f"{file} is not a regular file; a dump is read only from regular files.")
    return os.fdopen(fd, "rb")


NPY_ERRORS = (
    ValueError,
    OSError,
    zipfile.BadZipFile,
    EOFError,
    SyntaxError,
    TypeError,
    RuntimeError,
    NotImplementedError,
)  # RuntimeError: an encrypted member; NotImplementedError: its compression
# the header np.save writes for a plain dtype; anything else goes through numpy's own (literal-only) parser
_NPY_HEADER = re.compile(
    r"\{'descr': '([<>|=]?[a-zA-Z][0-9]*)', 'fortran_order': (True|False), "
    r"'shape': \(((?:[0-9]+, ?)*[0-9]*)\), \}\s*"
)


def open_npz(fh: IO[bytes], file: str, needed: dict, max_bytes: int) -> zipfile.ZipFile:
    """Open the archive after checking its size, magic and zip directory, before anything is inflated."""
    size = os.fstat(fh.fileno()).st_size
    if size > max_bytes + 1024 * (len(needed) + 1) + 2**20:  # a stored zip is its data plus small headers
        raise DumpError(
            f"{file} is {size} bytes, more than max_bytes={max_bytes} of arrays can take. If you "
            "trust this dump, pass a larger max_bytes= to load_dump."
        )
    if fh.read(4) not in (b"PK\x03\x04", b"PK\x05\x06"):
        raise DumpError(f"{file} is not a zip archive (.npz); the dump is damaged or was not written by jaxsane.")
    fh.seek(0)
    try:
        zf = zipfile.ZipFile(fh)
    except NPY_ERRORS as e:
        raise DumpError(f"{file} is not a readable .npz archive ({e}); the dump is truncated or damaged.") from None
    infos = {i.filename: i for i in zf.infolist()}
    total = sum(i.file_size for i in infos.values())
    if total > max_bytes:
        zf.close()
        raise DumpError(
            f"{file} declares {total} bytes of arrays once inflated, over max_bytes={max_bytes}. "
            "If you trust this dump, pass a larger max_bytes= to load_dump."
        )
    for name, meta in needed.items():
        if f"{name}.npy" not in infos:
            zf.close()
            raise DumpError(
                f"{file} lacks the array {name}.npy for {meta.get('path') or name}; the dump is incomplete."
            )
    return zf


def read_npy(zf: zipfile.ZipFile, file: str, name: str) -> np.ndarray:
    """Read one ``.npy`` member: header checked (no object dtypes, size matching the archive) before the
    array is allocated, then exactly its bytes, CRC-checked. Nothing is ever unpickled."""
    info = zf.getinfo(f"{name}.npy")
    try:
        with cast(zipfile.ZipExtFile, zf.open(info)) as member:
            version = np.lib.format.read_magic(member)
            if version not in ((1, 0), (2, 0)):
                raise ValueError(f"unsupported .npy version {version}")
            hlen = struct.unpack("<H" if version == (1, 0) else "<I", member.read(2 if version == (1, 0) else 4))[0]
            if hlen > 10_000:
                raise ValueError(f"a header of {hlen} bytes")
            header = member.read(hlen).decode("latin1")
            match = _NPY_HEADER.fullmatch(header)
            if match:
                dtype, fortran = np.dtype(match[1]), match[2] == "True"
                shape = tuple(int(v) for v in match[3].replace(" ", "").split(",") if v)
            else:  # numpy's parser reads Python literals only (ast.literal_eval)
                member.seek(0)
                np.lib.format.read_magic(member)
                read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                shape, fortran, dtype = read(member)
            if dtype.hasobject:
                raise DumpError(
                    f"{file}: member {name}.npy holds Python objects (pickle); a dump never does. "
                    "The file was not written by jaxsane."
                )
            nbytes = math.prod(shape) * dtype.itemsize
            if member.tell() + nbytes != info.file_size:
                raise DumpError(
                    f"{file}: member {name}.npy declares shape {shape} of {dtype}, which does not "
                    "match its size in the archive; the dump is truncated or damaged."
                )
            buf = np.empty(nbytes, np.uint8)
            view = memoryview(buf)  # type: ignore[arg-type]  # numpy's stubs: an ndarray is a Buffer
            if nbytes and member.readinto(view) != nbytes:
                raise ValueError("the member ends early")
            if member.read(1):  # reading to the end also checks the CRC
                raise ValueError("the member is longer than its header says")
        if dtype.itemsize == 0:
            return np.empty(shape, dtype)
        return buf.view(dtype).reshape(shape, order="F" if fortran else "C")
    except DumpError:
        raise
    except NPY_ERRORS as e:
        raise DumpError(
            f"{file}: member {name}.npy cannot be read ({type(e).__name__}: {str(e)[:200]}); the dump "
            "is truncated or damaged."
        ) from None

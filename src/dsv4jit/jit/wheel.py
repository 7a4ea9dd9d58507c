"""A wheel of prebuilt kernels: cache entries and their tags packed as an installable package.

The wheel holds the import package `prebuilt.PACKAGE`, which is a cache root (each entry's
``module.so`` and ``manifest.json`` at its place under ``v1/``, the tags in `prebuilt.TAGS`, an
``__init__.py`` that says what it is), and its ``.dist-info`` (METADATA, WHEEL, RECORD). Its version
is `prebuilt.version` (dsv4jit's, labelled with the toolkit and tvm-ffi), its tag
``py3-none-linux_<cpu>``, since the modules link no libpython. Members go in a fixed order with a
fixed time, so the same entries give the same bytes."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import zipfile
from pathlib import Path

from .prebuilt import DISTRIBUTION, PACKAGE, TAGS, version

_NAME = DISTRIBUTION.replace("-", "_")  # the distribution's name as wheel file names spell it
ENTRY_FILES = ("module.so", "manifest.json")  # what a lookup reads; build logs and sources stay behind
ZIP_TIME = (1980, 1, 1, 0, 0, 0)


def wheel_tag(tags: dict) -> str:
    return f"py3-none-linux_{tags['platform'].split('-')[0]}"


def filename(tags: dict) -> str:
    return f"{_NAME}-{version(tags)}-{wheel_tag(tags)}.whl"


def dist_info(tags: dict) -> str:
    return f"{_NAME}-{version(tags)}.dist-info"


def _members(entries: list[Path], tags: dict) -> list[tuple[str, bytes]]:
    """(path in the wheel, content) of everything but RECORD."""
    arches = ", ".join(tags["arches"])
    init = (f'"""Prebuilt dsv4jit kernels for {arches} (CUDA {tags["cuda"]}, tvm-ffi {tags["tvm_ffi"]}): a read-only '
            f'kernel cache that dsv4jit finds by itself; {TAGS} holds the facts of the build."""\n')
    members = [(f"{PACKAGE}/__init__.py", init.encode()),
               (f"{PACKAGE}/{TAGS}", (json.dumps(tags, indent=1) + "\n").encode())]
    for entry in sorted(entries):
        place = entry.relative_to(entry.parents[3]).as_posix()  # v1/<arch>/<kernel>/<slug>-<key>
        members += [(f"{PACKAGE}/{place}/{name}", (entry / name).read_bytes()) for name in ENTRY_FILES]
    info = dist_info(tags)
    metadata = "\n".join([
        "Metadata-Version: 2.1",
        f"Name: {DISTRIBUTION}",
        f"Version: {version(tags)}",
        f"Summary: Prebuilt dsv4jit kernels for {arches}, built with CUDA {tags['cuda']} and tvm-ffi {tags['tvm_ffi']}",
        "License: Apache-2.0",
        f"Requires-Dist: dsv4jit=={tags['dsv4jit']}",
        f"Requires-Dist: apache-tvm-ffi=={tags['tvm_ffi']}",
    ]) + "\n"
    wheel = "\n".join([
        "Wheel-Version: 1.0",
        f"Generator: dsv4jit {tags['dsv4jit']}",
        "Root-Is-Purelib: false",
        f"Tag: {wheel_tag(tags)}",
    ]) + "\n"
    return members + [(f"{info}/METADATA", metadata.encode()), (f"{info}/WHEEL", wheel.encode())]


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def write_wheel(entries: list[Path], tags: dict, out_dir: Path) -> Path:
    """Write the wheel of `entries` (cache entry folders) tagged `tags` into `out_dir`; returns its path.
    Written to a temporary file and renamed, so a failure leaves no partial wheel."""
    members = _members(entries, tags)
    record = f"{dist_info(tags)}/RECORD"
    lines = [_record_line(name, data) for name, data in members] + [f"{record},,"]
    members.append((record, ("\n".join(lines) + "\n").encode()))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / filename(tags)
    tmp = out_dir / f".{path.name}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f, zipfile.ZipFile(f, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
            for name, data in members:
                item = zipfile.ZipInfo(name, ZIP_TIME)
                item.external_attr = 0o644 << 16
                item.compress_type = zipfile.ZIP_DEFLATED
                z.writestr(item, data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path

"""Cache keys, roots and entries.

An entry lives at ``<root>/v<SCHEMA>/<arch>/<kernel>/<slug>-<key>/`` and holds ``module.so``,
``manifest.json`` (written last: its presence marks a complete entry; it records the module's size
and sha256, checked before every load) and ``build.log``. Beside the entries of a kernel folder,
builds leave folders that are never entries (`STAGE`, `OLD`, `BAD`), and ``<root>/failed/`` keeps
the logs of failed builds. The key is
a sha256 over a canonical JSON document: schema, variant id, generated wrapper text, digests of the
in-package header closure, the normalised compile command, the arch, the compiler identity, the
tvm-ffi version and include digest, and the platform. Install locations are replaced by tokens, so
a copied or re-cloned package hits the same entries; the torch and Python versions are not part of
the key because modules link neither.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import os
import platform
import re
import uuid
from dataclasses import dataclass
from pathlib import Path

from .. import env
from ..errors import DSV4JITCacheError, DSV4JITToolchainError
from . import metadata
from .registry import Variant
from .toolchain import Arch

SCHEMA = 1
KEY_CHARS = 20
CSRC = Path(__file__).resolve().parent.parent / "csrc"

# Name prefixes of the folders beside a kernel folder's entries (build.py makes them, ``clean``
# removes them): a build in progress or abandoned, an entry swapped out by a forced rebuild, a damaged
# entry set aside for inspection.
STAGE, OLD, BAD = ".stage-", ".old-", ".bad-"

_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*(?:"([^"]+)"|<([^>]+)>|(\S+))', re.M)


def _sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _digest_tree(root: Path, patterns=("*.h", "*.cuh", "*.hpp")) -> str:
    h = hashlib.sha256()
    for p in sorted(q for pat in patterns for q in root.rglob(pat)):
        h.update(str(p.relative_to(root)).encode())
        h.update(_sha256_file(p).encode())
    return h.hexdigest()


def header_closure(header: str, csrc: Path | None = None) -> dict[str, str]:
    """``{path relative to csrc: sha256}`` of every in-package file reachable from ``header``.

    Quoted includes resolve against the including file's folder, then ``csrc``; files outside the
    package (CUDA, tvm-ffi) are covered by the toolchain and tvm-ffi parts of the key. A computed
    include (``#include MACRO``) makes the scan unreliable, so the whole tree digest is used instead.
    """
    csrc = CSRC if csrc is None else csrc
    seen: dict[str, str] = {}
    todo = [csrc / header]
    while todo:
        path = todo.pop()
        rel = str(path.relative_to(csrc))
        if rel in seen:
            continue
        seen[rel] = _sha256_file(path)
        for quoted, angled, computed in _INCLUDE.findall(path.read_text()):
            if computed:
                return {"<tree>": _digest_tree(csrc)}
            name = quoted or angled
            for base in ((path.parent, csrc) if quoted else (csrc,)):
                cand = (base / name).resolve()
                if cand.is_file() and csrc in cand.parents:
                    todo.append(cand)
                    break
    return dict(sorted(seen.items()))


@functools.lru_cache(maxsize=None)
def _closure_memo(header: str) -> tuple:
    return tuple(header_closure(header).items())


@functools.lru_cache(maxsize=None)
def tvm_ffi_info() -> dict:
    """Version and include-folder digest of tvm-ffi (covers editable installs), plus its paths."""
    try:
        import tvm_ffi
        import tvm_ffi.libinfo as li
    except ImportError as e:  # a declared dependency: a broken install, said as such
        raise DSV4JITToolchainError(f"apache-tvm-ffi is not importable ({e}): dsv4jit builds and loads its kernels "
                                    "through it; install it (pip install apache-tvm-ffi)") from e

    include = Path(li.find_include_path())
    dlpack = Path(li.find_dlpack_include_path())
    lib = Path(li.find_libtvm_ffi()).parent
    return {"version": tvm_ffi.__version__, "include_digest": _digest_tree(include),
            "include": include, "dlpack": dlpack, "lib": lib}


def platform_tag() -> str:
    libc, ver = platform.libc_ver()
    return f"{platform.machine()}-{libc or 'unknown'}{ver}"


@dataclass(frozen=True)
class KeyInfo:
    key: str
    source_key: str  # key without the toolchain identity (lookup on hosts without nvcc)
    document: dict


def make_key(variant: Variant, arch: Arch, normalized_command: list[str], toolchain_identity: dict | None,
             header_digests: dict[str, str] | None = None, platform: str | None = None) -> KeyInfo:
    """`platform`: another platform tag than this machine's (the keys of prebuilt kernels built on a
    compatible one, jit/prebuilt.py)."""
    tvm = tvm_ffi_info()
    document = {
        "schema": SCHEMA,
        "variant": variant.id,
        "wrapper": variant.wrapper_source(),
        "headers": header_digests if header_digests is not None else dict(_closure_memo(variant.spec.header)),
        "command": normalized_command,
        "arch": arch.name,
        "cudart": "none" if arch.is_host else "static",
        "tvm_ffi": {"version": tvm["version"], "include_digest": tvm["include_digest"]},
        "platform": platform or platform_tag(),
    }
    source_key = _hash(document)
    if toolchain_identity is not None:
        document["toolchain"] = toolchain_identity
    return KeyInfo(_hash(document), source_key, document)


def _hash(document: dict) -> str:
    text = json.dumps(document, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:KEY_CHARS]


# --------------------------------------------------------------------------------------------
# Roots and entries


def write_root(root: Path | None = None) -> Path:
    """The write root: `root` when given (``precompile --cache-dir``), else DSV4JIT_CACHE_DIR's."""
    return env.cache_dir() if root is None else root


def roots(root: Path | None = None) -> list[Path]:
    """The write root (see `write_root`) first, then the read-only search roots."""
    return [write_root(root), *env.cache_path()]


def schema_dir(root: Path) -> Path:
    """The folder of this schema's entries; folders of other schemas beside it are stale."""
    return root / f"v{SCHEMA}"


def failed_dir(root: Path) -> Path:
    """Where failed builds keep their log and wrapper source (``<slug>-<key>/``)."""
    return root / "failed"


def kernel_dir(root: Path, arch: Arch, variant: Variant) -> Path:
    return schema_dir(root) / arch.name / variant.spec.name


def entry_dir(root: Path, arch: Arch, variant: Variant, key: str) -> Path:
    return kernel_dir(root, arch, variant) / f"{variant.slug}-{key}"


@dataclass(frozen=True)
class Damaged:
    """A folder at an entry's path whose files do not match its manifest (never loaded)."""

    entry: Path
    problem: str


def entry_of(folder: Path) -> Path:
    """The entry whose key a stage, swapped-out or set-aside folder (`stage_dir`, `aside_dir`) is of:
    that key's lock guards them all. An entry is its own."""
    name = folder.name
    if name.startswith(STAGE):
        return folder.with_name(name[len(STAGE):].rsplit("-", 2)[0])
    for prefix in (OLD, BAD):
        if name.startswith(prefix):
            return folder.with_name(name[len(prefix):].rsplit("-", 1)[0])
    return folder


def stage_dir(entry: Path) -> Path:
    """A new folder to build `entry` in, beside it: the builder's pid and a random part make it unique."""
    return entry.with_name(f"{STAGE}{entry.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def aside_dir(entry: Path, prefix: str) -> Path:
    """A new name for `entry` moved out of the way (`OLD` or `BAD`)."""
    return entry.with_name(f"{prefix}{entry.name}-{uuid.uuid4().hex[:8]}")


def folders(folder: Path, pattern: str) -> list[Path]:
    """``folder.glob(pattern)``, sorted; nothing where `folder` cannot be read (missing, another
    user's, a path over the length limit): lookups and listings go on without it."""
    try:
        return sorted(folder.glob(pattern))
    except OSError:
        return []


def module_record(image: bytes) -> dict:
    """What a manifest records of ``module.so`` (its bytes), checked before every load (`verified_module`)."""
    return {"size": len(image), "sha256": hashlib.sha256(image).hexdigest()}


def _read_module(module: Path) -> bytes:
    return module.read_bytes()


#: The fields of ``manifest.json`` (build.py writes them) and their kinds (`metadata.read`): a
#: manifest with a field missing or of another kind is damaged, like one that does not parse.
MANIFEST_FIELDS = {"key": str, "source_key": str, "variant": str, "arch": str, "document": dict,
                   "built_at": metadata.NUMBER, "build_seconds": metadata.NUMBER, "size": metadata.COUNT,
                   "sha256": str, "dsv4jit_version": str, "depfile": list}


def read_manifest(entry: Path) -> dict | None:
    """The entry's manifest when it parses and has every field of its type (`MANIFEST_FIELDS`)."""
    return metadata.read(entry / "manifest.json", MANIFEST_FIELDS)[0]


def verified_module(entry: Path, key: str | None = None) -> tuple[bytes | None, str | None]:
    """The bytes of the entry's ``module.so`` when they match its manifest (and the manifest names
    `key`), else None and why the entry must not be loaded.

    Checked before loading because a truncated module kills the process with SIGBUS and a module of
    another variant would load silently. The bytes checked are the ones a load maps, from a private
    copy (loader.py), so that nothing done to the file after the check reaches the process. Costs
    reading and hashing the module (about 1 ms per MB), once per variant and process.
    """
    manifest, problem = metadata.read(entry / "manifest.json", MANIFEST_FIELDS)
    if problem is not None:
        return None, f"manifest.json is {problem}"
    if key is not None and manifest["key"] != key:
        return None, f"manifest.json is for key {manifest['key']}, not {key}"
    module = entry / "module.so"
    try:  # it may be unreadable (permissions), or removed meanwhile by a concurrent clean
        size = module.stat().st_size  # before reading: a file of another size is not read at all
        if size != manifest["size"]:
            return None, f"module.so has {size} bytes, the manifest records {manifest['size']}"
        image = _read_module(module)
    except OSError as e:
        return None, f"module.so cannot be read ({e.strerror})"
    if module_record(image) != {"size": manifest["size"], "sha256": manifest["sha256"]}:
        return None, "module.so does not match the sha256 in manifest.json"
    return image, None


def find_entry(variant: Variant, arch: Arch, info: KeyInfo | None, source_key: str | None = None,
               root: Path | None = None) -> tuple[Path | None, bytes | None, list[Damaged]]:
    """First verified entry in the roots (`roots`) with its module's bytes (`verified_module`), and
    the damaged ones met on the way. With no toolchain (``info`` None) match on the source key. A
    root that cannot be read is searched as an empty one."""
    return search(roots(root), variant, arch, info, source_key)


def search(searched_roots: list[Path], variant: Variant, arch: Arch, info: KeyInfo | None,
           source_key: str | None = None) -> tuple[Path | None, bytes | None, list[Damaged]]:
    """`find_entry` in the given roots, in their order."""
    damaged: list[Damaged] = []
    for searched in searched_roots:
        if info is not None:
            candidates = [entry_dir(searched, arch, variant, info.key)]
        else:
            matches = [(manifest["built_at"], entry)
                       for entry in folders(kernel_dir(searched, arch, variant), f"{variant.slug}-*")
                       if (manifest := read_manifest(entry)) and manifest["source_key"] == source_key]
            candidates = [entry for _, entry in sorted(matches, reverse=True)]  # most recently built first
        for entry in candidates:
            if not os.path.isdir(entry):  # False, not an error, where the path cannot be read
                continue
            image, problem = verified_module(entry, info.key if info is not None else None)
            if image is not None:
                return entry, image, damaged
            damaged.append(Damaged(entry, problem))
    return None, None, damaged


def iter_entries(root: Path):
    """Every complete entry under a root, with its manifest (for list/clean); never the stages,
    swapped-out and set-aside folders beside them, whose names start with a dot."""
    for manifest_file in folders(schema_dir(root), "*/*/[!.]*/manifest.json"):
        manifest = read_manifest(manifest_file.parent)
        if manifest is not None:
            yield manifest_file.parent, manifest


def dir_size(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


def unwritable(root: Path) -> str | None:
    """Why nothing can be built into `root` (made if missing), or None when it can."""
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return e.strerror or str(e)
    return None if os.access(root, os.W_OK | os.X_OK) else "write access denied"


def write_error(e: OSError, where: Path, setting: str = "DSV4JIT_CACHE_DIR") -> DSV4JITCacheError:
    """A failed write into the cache (no permission, a full disk, a read-only or too long path, a
    folder where a file belongs, ...) as the place, the reason and the variable that moves it."""
    path = f" ({e.filename})" if e.filename and Path(e.filename) != where else ""
    fix = "a shorter path" if e.errno == errno.ENAMETOOLONG else "a writable folder with free space"
    return DSV4JITCacheError(f"dsv4jit: cannot write the kernel cache at {where}: {e.strerror or e}{path}; "
                             f"set {setting} to {fix}")

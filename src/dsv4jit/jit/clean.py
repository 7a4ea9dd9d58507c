"""Removing entries and build leftovers from the write root (what ``python -m dsv4jit clean`` does).

Only the write root is touched: search roots (DSV4JIT_CACHE_PATH) are never cleaned. Lock files and
``toolchain.json`` are kept, and an entry, or a stage or set-aside folder of its key, is removed
under the key's lock, so a concurrent builder of that key is not disturbed.
"""

from __future__ import annotations

import errno
import functools
import os
import shutil
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from .. import env
from ..errors import DSV4JITCacheError
from . import cache, loader
from .lock import KeyLock, lock_file
from .kernels import SPECS
from .registry import parse_variant_id
from .toolchain import Arch


@dataclass(frozen=True)
class Cleaned:
    root: Path  # the write root cleaned
    removed: list[Path]  # sorted; with dry_run, what would have been removed
    bytes: int  # their size
    dry_run: bool


def clean(*, everything: bool = False, archs: Collection[str] = (), kernels: Collection[str] = (),
          stale: bool = False, older_than: float | None = None, orphans: bool = False, dry_run: bool = False,
          root: Path | None = None) -> Cleaned:
    """Remove from the write root `root` (default: DSV4JIT_CACHE_DIR's), or with `dry_run` only list:

    everything: every entry and every leftover (`_leftovers`);
    archs, kernels: the entries built for these arches (names such as ``sm_90a``) or of these kernels;
    stale: the leftovers, and the entries whose key is no longer their variant's current one;
    older_than: the entries built more than this many seconds ago;
    orphans: the entries of variants the registry no longer has.
    """
    root = cache.write_root(root)
    _check_readable(root)
    now = time.time()
    doomed = _leftovers(root, now) if everything or stale else []
    if stale:
        doomed += _superseded(root)
    for entry, manifest in cache.iter_entries(root):
        arch, kernel = entry.parent.parent.name, entry.parent.name
        if (everything or arch in archs or kernel in kernels or (orphans and is_orphan(manifest))
                or (older_than is not None and now - manifest.get("built_at", now) > older_than)):
            doomed.append(entry)
    doomed = sorted(set(doomed))
    freed = sum(cache.dir_size(p) for p in doomed)
    if not dry_run:
        for path in doomed:
            _remove(root, path)
    return Cleaned(root, doomed, freed, dry_run)


def _check_readable(root: Path) -> None:
    """A root that exists but cannot be read is an error: cleaning it would remove nothing, silently.
    One that does not exist (or cannot: a path over the length limit, a file on the way) holds nothing."""
    try:
        os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return
    except OSError as e:
        if e.errno != errno.ENAMETOOLONG:
            raise DSV4JITCacheError(f"dsv4jit: cannot read the kernel cache at {root}: {e.strerror or e}; nothing "
                                    "was removed (clean needs to read and write DSV4JIT_CACHE_DIR)") from e


def _leftovers(root: Path, now: float) -> list[Path]:
    """What no lookup reads: folders of other cache schemas, stages older than DSV4JIT_BUILD_TIMEOUT
    (younger ones may be live builds), entries swapped out by a forced rebuild or set aside as
    damaged, and the logs of failed builds."""
    base = cache.schema_dir(root)
    timeout = env.build_timeout()
    found = [p for p in cache.folders(root, "v*") if os.path.isdir(p) and p.name != base.name]
    found += [p for p in cache.folders(base, f"*/*/{cache.STAGE}*") if now - _mtime(p, now) > timeout]
    found += cache.folders(base, f"*/*/{cache.OLD}*") + cache.folders(base, f"*/*/{cache.BAD}*")
    if os.path.isdir(cache.failed_dir(root)):
        found.append(cache.failed_dir(root))
    return found


def _mtime(path: Path, now: float) -> float:
    try:
        return path.stat().st_mtime
    except OSError:  # gone meanwhile (its build ended): nothing to remove
        return now


def _superseded(root: Path) -> list[Path]:
    """Entries of registry variants whose key is no longer the current one (old headers, flags or
    toolchain); computing current keys needs the toolchain. Orphans are left to `is_orphan`."""
    old = []
    for entry, manifest in cache.iter_entries(root):
        try:
            variant = parse_variant_id(manifest["variant"], SPECS)
        except (KeyError, ValueError):
            continue
        res = loader.resolve(variant, Arch(manifest["arch"]), root)
        if res.info is not None and res.info.key != manifest.get("key"):
            old.append(entry)
    return old


def is_orphan(manifest: dict) -> bool:
    """Whether an entry's variant is one the registry no longer has."""
    return manifest.get("variant") not in _registry_ids()


@functools.lru_cache(maxsize=None)
def _registry_ids() -> frozenset[str]:
    return frozenset(v.id for spec in SPECS.values() for v in spec.all_variants())


def _remove(root: Path, path: Path) -> None:
    """Delete under the lock of the key `path` is of (an entry, or a stage or set-aside folder of
    its key), where builders take it, if that lock file exists: a key's builder never loses its
    stage, or the entry it is checking, to a concurrent clean."""
    if path.parent.parent.parent != cache.schema_dir(root):  # not of a key: an old schema, failed/
        shutil.rmtree(path, ignore_errors=True)
        return
    lock = lock_file(root, path)
    if not lock.exists():
        shutil.rmtree(path, ignore_errors=True)
        return
    with KeyLock(lock, cache.entry_of(path).name):
        shutil.rmtree(path, ignore_errors=True)

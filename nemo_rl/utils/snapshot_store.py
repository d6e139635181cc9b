"""Atomic on-disk layout for trainer anchors and rollout snapshots.

A crash can happen at any byte, so nothing is ever edited in place: a
snapshot or trainer step is written into a ``.tmp-*`` sibling, sealed with a
``manifest.json`` that lists every file with its sha256 and size (written
last, fsynced: the commit marker), and renamed into place.

Reading costs what it must and no more (a trainer step can be gigabytes):

- listing and pruning *trust* the commit marker: the manifest parses and every
  listed file is a regular file with its listed size, reached through no
  symbolic link (lstat and stat only, no file is read);
- a restore *verifies* only the directory it restores (every sha256, and
  nothing in it a symbolic link or a special file: a checkpoint dir is
  untrusted input), and skips a bad one, naming the entry, for the next older one;
- sealing reads nothing back that ``atomic_write`` wrote inside
  ``recording_digests``: the digest is taken from the bytes as they are
  written. Other files (a library's ``save_pretrained``) are hashed once.

Every file written here, every rename, directory made and directory removed
goes through the ``StorageWriter`` the caller passes
(``gym_patches.checkpoint.storage``, the one definition both sides share; the
run store, ``rollout_snapshot/store.py``: ``RunStore``, passes the one it was
built with), so a test hands in a writer that fails like a full disk without
this module knowing about it. A caller that passes none writes plain files
(``atomic_write.PLAIN_FILES``). Reads are plain file reads.

Layout::

    <checkpoint_dir>/bootstrap/                      anchor for step 0
    <checkpoint_dir>/step_<N>/manifest.json           trainer step N
    <anchor>/rollout_snapshots/snapshot_<SEQ>[-tag]/  one rollout snapshot
    <anchor>/rollout_snapshots/.tmp-snapshot_<...>/   unpublished (ignored)
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import stat
import time
from pathlib import Path
from typing import Any, Collection, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gym_patches.checkpoint.storage import StorageWriter
from nemo_rl.utils.atomic_write import PLAIN_FILES, WrittenDigests, write_json_atomic
from nemo_rl.utils.write_errors import naming_write

MANIFEST_NAME = "manifest.json"
SNAPSHOTS_DIRNAME = "rollout_snapshots"
SNAPSHOT_PREFIX = "snapshot_"
TMP_PREFIX = ".tmp-"
BOOTSTRAP_DIRNAME = "bootstrap"
STORE_SCHEMA_VERSION = 1

_SNAPSHOT_NAME = re.compile(r"^(?P<seq>[0-9]{1,18})(?:-[A-Za-z0-9._-]{1,64})?$")
_STEP_DIR = re.compile(r"^step_(?P<step>[0-9]+)$")
_CHUNK = 1 << 20


class SnapshotStoreError(ValueError):
    """A snapshot or trainer directory that cannot be used (names the path)."""


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


# ----- manifests -----------------------------------------------------------
class FileEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size: int = Field(ge=0)


class DirectoryManifest(BaseModel):
    """Seal of a published directory; ``files`` keys are POSIX relative paths."""

    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[1] = STORE_SCHEMA_VERSION
    kind: Literal["rollout_snapshot", "trainer_step", "bootstrap"]
    sequence: int = Field(ge=0)  # snapshot sequence, or trainer step
    created_at: float
    files: dict[str, FileEntry]
    metadata: dict[str, Any] = Field(default_factory=dict)


def _listed_files(root: Path, skip_subdirs: tuple[str, ...] = ()) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        if rel_dir == Path("."):
            dirnames[:] = [d for d in dirnames if d not in skip_subdirs]
        for name in filenames:
            rel = (rel_dir / name).as_posix()
            if rel != MANIFEST_NAME:
                out.append(rel)
    return sorted(out)


def _seal(
    root: Path,
    kind: str,
    sequence: int,
    metadata: dict[str, Any] | None,
    skip_subdirs: tuple[str, ...] = (),
    digests: WrittenDigests | None = None,
    writer: StorageWriter = PLAIN_FILES,
) -> DirectoryManifest:
    """List every file with its digest, then write the manifest last (through ``writer``).

    A file in ``digests`` (written by ``write_bytes_atomic``) is not read again; any other (Gym's
    records, a staged library file) is hashed here, once. Every file reached the directory through
    a writer, which made it durable; the writer's commit of the directory makes the tree durable.
    """
    files = {}
    for rel in _listed_files(root, skip_subdirs):
        path = root / rel
        if path.is_symlink() or not path.is_file():
            raise SnapshotStoreError(f"{path}: only regular files may be published")
        written = digests.entry(rel, path) if digests is not None else None
        if written is not None:
            files[rel] = FileEntry(sha256=written.sha256, size=written.size)
            continue
        with naming_write(path):
            files[rel] = FileEntry(sha256=sha256_file(path), size=path.stat().st_size)
    manifest = DirectoryManifest(
        kind=kind, sequence=sequence, created_at=time.time(), files=files, metadata=metadata or {}
    )
    write_json_atomic(root / MANIFEST_NAME, manifest.model_dump(mode="json"), writer)
    return manifest


def _not_regular(path: Path) -> str | None:
    """Why ``path`` cannot be part of a sealed directory (None: a regular file or a real directory)."""
    mode = os.lstat(path).st_mode
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        return "not a regular file"
    return None


def _refuse(path: Path, why: str) -> SnapshotStoreError:
    return SnapshotStoreError(f"{path}: {why}; a sealed directory holds only regular files and directories")


def _check_listed(root: Path, rel: str) -> None:
    """``root / rel`` and every directory on the way to it are real (no link, nothing special), by lstat."""
    path = root
    for part in Path(rel).parts:
        path = path / part
        why = _not_regular(path)
        if why is not None:
            raise _refuse(path, why)
    if not stat.S_ISREG(os.lstat(path).st_mode):
        raise _refuse(path, "not a regular file")


def _check_tree(root: Path, skip_subdirs: tuple[str, ...]) -> None:
    """Every entry under ``root`` (and ``root``) is a regular file or a real directory: a restore reads a
    checkpoint dir as untrusted input, so a link that points out of it is refused, not followed."""
    why = _not_regular(root)
    if why is not None:
        raise _refuse(root, why)
    for dirpath, dirnames, filenames in os.walk(root):  # does not follow links
        for name in sorted(dirnames + filenames):
            why = _not_regular(Path(dirpath) / name)
            if why is not None:
                raise _refuse(Path(dirpath) / name, why)
        if Path(dirpath) == root:
            dirnames[:] = [d for d in dirnames if d not in skip_subdirs]


def trust_directory(root: str | Path, kind: str | None = None) -> DirectoryManifest:
    """The manifest if ``root``'s commit marker holds: it parses (of ``kind``) and every listed file
    is a regular file with its listed size, reached through no symbolic link. Stat only, nothing is read
    but the manifest; else raise naming the file."""
    root = Path(root)
    manifest_path = root / MANIFEST_NAME
    try:
        _check_listed(root, MANIFEST_NAME)
        raw = manifest_path.read_bytes()
    except FileNotFoundError:
        raise SnapshotStoreError(f"{manifest_path}: missing") from None
    try:
        manifest = DirectoryManifest.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "<root>"
        raise SnapshotStoreError(f"{manifest_path}: unreadable manifest ({where}: {first['msg']})") from None
    if kind is not None and manifest.kind != kind:
        raise SnapshotStoreError(f"{manifest_path}: kind {manifest.kind!r}, expected {kind!r}")
    for rel, entry in manifest.files.items():
        path = root / rel
        if ".." in Path(rel).parts or Path(rel).is_absolute():
            raise SnapshotStoreError(f"{manifest_path}: file entry {rel!r} escapes the directory")
        try:
            _check_listed(root, rel)
        except FileNotFoundError:
            raise SnapshotStoreError(f"{path}: listed in the manifest but missing") from None
        size = path.stat().st_size
        if size != entry.size:
            raise SnapshotStoreError(f"{path}: size {size}, manifest says {entry.size}")
    return manifest


def verify_directory(root: str | Path, kind: str | None = None) -> DirectoryManifest:
    """The manifest if ``root`` is intact: trusted (``trust_directory``), nothing in it a link or a
    special file (its snapshots aside: each is verified on its own), and every file's sha256 matches.
    Reads every byte: only for a directory about to be restored. Else raise naming the file."""
    root = Path(root)
    manifest = trust_directory(root, kind)
    try:
        _check_tree(root, () if manifest.kind == "rollout_snapshot" else (SNAPSHOTS_DIRNAME,))
    except FileNotFoundError as exc:  # changed under us: as unusable as a torn one
        raise SnapshotStoreError(f"{exc.filename}: vanished while being verified") from None
    for rel, entry in manifest.files.items():
        if sha256_file(root / rel) != entry.sha256:
            raise SnapshotStoreError(f"{root / rel}: sha256 does not match the manifest")
    return manifest


# ----- rollout snapshots -----------------------------------------------------
def snapshots_root(anchor_dir: str | Path) -> Path:
    return Path(anchor_dir) / SNAPSHOTS_DIRNAME


def snapshot_sequence(name: str) -> int | None:
    """Sequence number of ``snapshot_<seq>[-tag]`` (or of its tmp twin), else None."""
    if name.startswith(TMP_PREFIX):
        name = name[len(TMP_PREFIX):]
    if not name.startswith(SNAPSHOT_PREFIX):
        return None
    match = _SNAPSHOT_NAME.match(name[len(SNAPSHOT_PREFIX):])
    return int(match["seq"]) if match else None


def next_snapshot_name(anchor_dir: str | Path, tag: str | None = None) -> str:
    """A name whose sequence is above every snapshot (valid, torn or tmp) seen here."""
    root = snapshots_root(anchor_dir)
    seqs = [snapshot_sequence(p.name) for p in root.iterdir()] if root.is_dir() else []
    seq = max((s for s in seqs if s is not None), default=0) + 1
    return f"{seq:06d}" + (f"-{tag}" if tag else "")


def next_snapshot_path(anchor_dir: str | Path) -> Path:
    """Where the next snapshot under ``anchor_dir`` is published (nothing is created): for a snapshot
    whose temporary directory was made under an older anchor (``commit_snapshot`` moves it here)."""
    return snapshots_root(anchor_dir) / f"{SNAPSHOT_PREFIX}{next_snapshot_name(anchor_dir)}"


def prepare_snapshot_paths(anchor_dir: str | Path, snapshot_name: str | None = None,
                           writer: StorageWriter = PLAIN_FILES) -> tuple[Path, Path]:
    """``(tmp_dir, final_dir)`` for a new snapshot; ``tmp_dir`` is created empty.

    ``snapshot_name`` is ``<sequence>[-tag]``; None picks the next sequence.
    """
    if snapshot_name is None:
        snapshot_name = next_snapshot_name(anchor_dir)
    if not _SNAPSHOT_NAME.match(snapshot_name):
        raise SnapshotStoreError(
            f"snapshot_name {snapshot_name!r} must be '<sequence>[-tag]' ({_SNAPSHOT_NAME.pattern})"
        )
    root = snapshots_root(anchor_dir)
    final_dir = root / f"{SNAPSHOT_PREFIX}{snapshot_name}"
    tmp_dir = root / f"{TMP_PREFIX}{SNAPSHOT_PREFIX}{snapshot_name}"
    if final_dir.exists():
        raise SnapshotStoreError(f"{final_dir}: snapshot already exists")
    writer.remove(tmp_dir)
    writer.make_dirs(tmp_dir)
    return tmp_dir, final_dir


def commit_snapshot(
    tmp_dir: str | Path,
    final_dir: str | Path,
    keep_latest_k: int,
    metadata: dict[str, Any] | None = None,
    digests: WrittenDigests | None = None,
    writer: StorageWriter = PLAIN_FILES,
    spare: frozenset[Path] = frozenset(),
) -> DirectoryManifest:
    """Seal ``tmp_dir`` with a manifest (written through ``writer``), rename it to ``final_dir``, prune old ones
    (not those in ``spare``: snapshots an in-run recovery may still restore from).

    ``final_dir`` may lie under another anchor than ``tmp_dir`` (a snapshot re-anchored to a trainer
    step published while it was taken): the one rename moves it there, both parents are fsynced.
    ``digests`` (from ``recording_digests(tmp_dir)``) spares the seal reading those files back.
    """
    tmp_dir, final_dir = Path(tmp_dir), Path(final_dir)
    if keep_latest_k < 1:
        raise SnapshotStoreError("keep_latest_k must be >= 1")
    seq = snapshot_sequence(final_dir.name)
    if seq is None or final_dir.name.startswith(TMP_PREFIX):
        raise SnapshotStoreError(f"{final_dir}: not a snapshot_<sequence> directory name")
    if final_dir.exists():
        raise SnapshotStoreError(f"{final_dir}: snapshot already exists")
    manifest = _seal(tmp_dir, "rollout_snapshot", seq, metadata, digests=digests, writer=writer)
    writer.make_dirs(final_dir.parent)
    writer.commit(tmp_dir, final_dir)
    _prune_snapshots(final_dir.parent, final_dir, keep_latest_k, writer, spare)
    return manifest


def _prune_snapshots(root: Path, newest: Path, keep_latest_k: int, writer: StorageWriter,
                     spare: frozenset[Path] = frozenset()) -> None:
    newest_seq = snapshot_sequence(newest.name)
    for path in root.iterdir():
        if path.name.startswith(TMP_PREFIX) and path.is_dir():
            # stale: the run lock (nemo_rl/utils/run_lock.py) makes this run the only writer, and its
            # attempts never overlap (the pump awaits each publish), so no other .tmp- dir is being written
            writer.remove(path)
    older = sorted(
        (
            (snapshot_sequence(p.name), p)
            for p in root.iterdir()
            if p.is_dir() and p != newest and snapshot_sequence(p.name) is not None
        ),
        reverse=True,
    )
    kept = 1
    for seq, path in older:
        if seq > newest_seq or path in spare:
            continue  # never touch a snapshot newer than the one just written, nor one a recovery may need
        if kept < keep_latest_k and _is_trusted(path, "rollout_snapshot"):
            kept += 1
            continue
        writer.remove(path)


def _is_trusted(path: Path, kind: str) -> bool:
    try:
        trust_directory(path, kind)
    except SnapshotStoreError:
        return False
    return True


class SnapshotSelection(NamedTuple):
    """The newest valid snapshot (None if none) and every skipped one with why."""

    path: Path | None
    skipped: list[tuple[Path, str]]
    manifest: DirectoryManifest | None = None


def resolve_latest_snapshot(anchor_dir: str | Path, required: tuple[str, ...] = ()) -> SnapshotSelection:
    """Pick the newest valid snapshot by sequence number (never by mtime) that lists every ``required``
    file; newer ones are skipped with the reason, in one scan. Only the chosen one (and the corrupt
    ones tried before it) is hashed: a snapshot is only resolved to be restored."""
    root = snapshots_root(anchor_dir)
    skipped: list[tuple[Path, str]] = []
    if not root.is_dir():
        return SnapshotSelection(None, skipped)
    candidates = []
    for path in sorted(root.iterdir()):
        seq = snapshot_sequence(path.name)
        if path.name.startswith(TMP_PREFIX):
            skipped.append((path, f"{path}: unpublished temporary directory"))
        elif seq is None or not path.is_dir():
            skipped.append((path, f"{path}: not a snapshot_<sequence> directory"))
        else:
            candidates.append((seq, path))
    for seq, path in sorted(candidates, reverse=True):
        try:
            manifest = verify_directory(path, "rollout_snapshot")
        except SnapshotStoreError as exc:
            skipped.append((path, str(exc)))
            continue
        if manifest.sequence != seq:
            skipped.append(
                (path, f"{path / MANIFEST_NAME}: sequence {manifest.sequence} does not match the name")
            )
            continue
        missing = [name for name in required if name not in manifest.files]
        if missing:
            skipped.append(
                (path, f"{path / missing[0]}: missing (not listed in {path / MANIFEST_NAME}; the restore needs it)")
            )
            continue
        return SnapshotSelection(path, skipped, manifest)
    return SnapshotSelection(None, skipped)


# ----- trainer anchors -----------------------------------------------------
def anchor_step_of(snapshot: str | Path) -> int:
    """The trainer step (0: ``bootstrap/``) whose anchor holds ``snapshot`` (``<anchor>/rollout_snapshots/<name>``)."""
    name = Path(snapshot).parent.parent.name
    if name == BOOTSTRAP_DIRNAME:
        return 0
    match = _STEP_DIR.match(name)
    if match is None:
        raise SnapshotStoreError(f"{snapshot}: not under a trainer step or bootstrap/ anchor")
    return int(match["step"])


def anchor_dir(checkpoint_dir: str | Path, step: int) -> Path:
    """``bootstrap/`` anchors snapshots before the first trainer step, else ``step_N/``."""
    if step < 0:
        raise SnapshotStoreError(f"step must be >= 0, got {step}")
    return Path(checkpoint_dir) / (BOOTSTRAP_DIRNAME if step == 0 else f"step_{step}")


def ensure_bootstrap_anchor(checkpoint_dir: str | Path, metadata: dict[str, Any] | None = None,
                            writer: StorageWriter = PLAIN_FILES) -> Path:
    """Create the step-0 anchor once (atomically, its manifest through ``writer``); an existing valid one is kept."""
    final = anchor_dir(checkpoint_dir, 0)
    if final.exists():
        verify_directory(final, "bootstrap")
        return final
    tmp = Path(checkpoint_dir) / f"{TMP_PREFIX}{BOOTSTRAP_DIRNAME}"
    writer.remove(tmp)
    writer.make_dirs(tmp)
    _seal(tmp, "bootstrap", 0, metadata, writer=writer)
    writer.commit(tmp, final)
    return final


def prepare_trainer_step(checkpoint_dir: str | Path, step: int,
                         writer: StorageWriter = PLAIN_FILES) -> tuple[Path, Path]:
    """``(tmp_dir, final_dir)`` for trainer step ``step`` (>= 1); tmp is created empty."""
    if step < 1:
        raise SnapshotStoreError(f"trainer steps start at 1, got {step}")
    final = anchor_dir(checkpoint_dir, step)
    tmp = Path(checkpoint_dir) / f"{TMP_PREFIX}{final.name}"
    writer.remove(tmp)
    writer.make_dirs(tmp)
    return tmp, final


def publish_trainer_step(
    tmp_dir: str | Path,
    final_dir: str | Path,
    metadata: dict[str, Any] | None = None,
    digests: WrittenDigests | None = None,
    writer: StorageWriter = PLAIN_FILES,
) -> DirectoryManifest:
    """Seal and rename a trainer step; a torn or corrupt ``step_N`` (one a restore skipped) is replaced.

    ``digests`` (from ``recording_digests(tmp_dir)`` around the trainer's save) spares the seal
    reading those files back; the rest are hashed once. ``writer``: the manifest's.
    """
    tmp_dir, final_dir = Path(tmp_dir), Path(final_dir)
    match = _STEP_DIR.match(final_dir.name)
    if not match:
        raise SnapshotStoreError(f"{final_dir}: not a step_<N> directory name")
    if final_dir.exists():  # rare (a restore went past it), so it is worth every byte to tell torn from valid
        try:
            verify_directory(final_dir, "trainer_step")
        except SnapshotStoreError:
            writer.remove(final_dir)
        else:
            raise SnapshotStoreError(f"{final_dir}: a valid trainer step already exists")
    manifest = _seal(tmp_dir, "trainer_step", int(match["step"]), metadata, (SNAPSHOTS_DIRNAME,), digests, writer)
    writer.commit(tmp_dir, final_dir)
    return manifest


def prune_trainer_steps(checkpoint_dir: str | Path, keep_top_k: int | None, newest: int | None = None,
                        spare: Collection[int] = (), writer: StorageWriter = PLAIN_FILES) -> list[Path]:
    """Delete all but the newest ``keep_top_k`` trusted trainer steps (``checkpointing.keep_top_k`` with
    no metric: the latest k), each with its rollout snapshots; ``bootstrap/`` counts as the oldest
    anchor, so it goes once k steps exist (until then its snapshots may still be restored with step 1:
    a crash right after step 1's checkpoint continues the rollouts they saved).

    Trust is the commit marker (``list_trainer_steps``): no checkpoint is read. ``newest`` is the step
    just saved: steps above it (ones a restore skipped as corrupt) neither count nor go. A directory
    is first renamed to a ``.tmp-`` name, so a crash mid-delete leaves nothing that looks valid
    (startup removes the rest). ``spare``: anchors kept beyond the k (those holding a snapshot some
    restore may still need: ``RunStore``'s retention, docs/design.md §5.4.7)."""
    if keep_top_k is None:
        return []
    if keep_top_k < 1:
        raise SnapshotStoreError(f"keep_top_k must be >= 1, got {keep_top_k}")
    steps = [s for s in list_trainer_steps(checkpoint_dir) if s > 0 and (newest is None or s <= newest)]
    if not steps:
        return []
    spare = set(spare)
    doomed = [anchor_dir(checkpoint_dir, s) for s in steps[:-keep_top_k] if s not in spare]
    bootstrap = anchor_dir(checkpoint_dir, 0)
    if bootstrap.exists() and len(steps) >= keep_top_k and 0 not in spare:
        doomed.append(bootstrap)
    removed = []
    for path in doomed:
        trash = path.parent / f"{TMP_PREFIX}deleted-{path.name}"
        writer.remove(trash)
        writer.commit(path, trash)
        writer.remove(trash)
        removed.append(path)
    return removed


def _anchor_dirs(checkpoint_dir: Path) -> list[tuple[int, str, Path]]:
    """``(step, kind, path)`` of every directory named like an anchor, newest first."""
    if not checkpoint_dir.is_dir():
        return []
    found = []
    for path in checkpoint_dir.iterdir():
        if path.name == BOOTSTRAP_DIRNAME:
            found.append((0, "bootstrap", path))
        elif match := _STEP_DIR.match(path.name):
            found.append((int(match["step"]), "trainer_step", path))
    return sorted(found, reverse=True)


def _trusted_anchor(step: int, kind: str, path: Path) -> DirectoryManifest:
    manifest = trust_directory(path, kind)
    if manifest.sequence != step:
        raise SnapshotStoreError(f"{path / MANIFEST_NAME}: sequence {manifest.sequence} does not match the name")
    return manifest


def list_trainer_steps(checkpoint_dir: str | Path) -> list[int]:
    """Steps whose commit marker holds (``trust_directory``: stat only), ascending; 0 stands for
    ``bootstrap/``. A torn step (no manifest, a file missing or of another size) is not listed."""
    steps = []
    for step, kind, path in _anchor_dirs(Path(checkpoint_dir)):
        with contextlib.suppress(SnapshotStoreError):
            _trusted_anchor(step, kind, path)
            steps.append(step)
    return sorted(steps)


class RestorePoint(NamedTuple):
    """The anchor to restore, its snapshot, and every newer anchor skipped with why."""

    step: int
    anchor: Path
    snapshot: SnapshotSelection
    skipped: tuple[tuple[Path, str], ...] = ()


def resolve_restore_point(
    checkpoint_dir: str | Path, required: tuple[str, ...] = (), *, read_snapshots: bool = True,
) -> RestorePoint | None:
    """The newest intact trainer anchor and the newest valid snapshot listing ``required`` (may be none;
    none either with ``read_snapshots=False``: the snapshots then stay unread).

    Anchors are tried newest first; only the one chosen is hashed (``verify_directory``), plus any
    newer one whose digests then fail: that one is in ``skipped`` with the bad file named, and the
    next older is tried. None when no anchor is intact.

    The snapshot is the newest under the chosen anchor or, when it has none yet (a crash between a
    trainer checkpoint and the next snapshot), the newest under an older anchor still on disk: a
    snapshot belongs to the anchor it was taken under, and restore drops from it what the newer
    trainer step trained (``RolloutRecoveryLedger.adopt_trained``).
    """
    skipped: list[tuple[Path, str]] = []
    anchors = _anchor_dirs(Path(checkpoint_dir))
    for i, (step, kind, path) in enumerate(anchors):
        try:
            _trusted_anchor(step, kind, path)  # stat first: a torn step costs no read
            verify_directory(path, kind)
        except SnapshotStoreError as exc:
            skipped.append((path, str(exc)))
            continue
        if not read_snapshots:
            return RestorePoint(step, path, SnapshotSelection(None, []), tuple(skipped))
        tried: list[tuple[Path, str]] = []
        for _, _, under in [(step, kind, path), *anchors[i + 1:]]:
            snapshot = resolve_latest_snapshot(under, required)
            tried += snapshot.skipped
            if snapshot.path is not None:
                break
        return RestorePoint(step, path, SnapshotSelection(snapshot.path, tried, snapshot.manifest), tuple(skipped))
    return None


class Listed(NamedTuple):
    """One directory of a checkpoint dir as the inspector shows it (``list_checkpoint_dir``)."""

    path: Path
    kind: Literal["bootstrap", "trainer_step", "rollout_snapshot", "temporary"]
    step: int | None  # an anchor's step (0: bootstrap); None for a snapshot or a temporary anchor
    manifest: DirectoryManifest | None  # its commit marker, when it holds (``trust_directory``)
    reason: str | None  # why it is not valid (None: valid, or temporary)
    size_bytes: int  # its own files (an anchor's snapshots not counted)
    snapshots: tuple["Listed", ...] = ()


def _tree_size(path: Path, skip: str | None = None) -> int:
    total = 0
    for dirpath, dirnames, filenames in os.walk(path):
        if skip and Path(dirpath) == path:
            dirnames[:] = [d for d in dirnames if d != skip]
        total += sum((Path(dirpath) / f).stat().st_size for f in filenames if (Path(dirpath) / f).is_file())
    return total


def _listed(path: Path, kind: str, step: int | None, skip: str | None = None) -> Listed:
    size = _tree_size(path, skip)
    if kind == "temporary":
        return Listed(path, "temporary", step, None, None, size)
    try:
        return Listed(path, kind, step, trust_directory(path, kind), None, size)  # type: ignore[arg-type]
    except SnapshotStoreError as exc:
        return Listed(path, kind, step, None, str(exc), size)  # type: ignore[arg-type]


def list_checkpoint_dir(checkpoint_dir: str | Path) -> list[Listed]:
    """Every anchor (newest first) with its snapshots (newest first), and the temporary directories a crash
    left (last). Stat only: each commit marker is trusted, nothing is hashed."""
    root = Path(checkpoint_dir)
    anchors = []
    for path in root.iterdir() if root.is_dir() else []:
        if path.name.startswith(TMP_PREFIX):
            anchors.append(_listed(path, "temporary", None))
            continue
        if path.name == BOOTSTRAP_DIRNAME:
            step, kind = 0, "bootstrap"
        elif match := _STEP_DIR.match(path.name):
            step, kind = int(match["step"]), "trainer_step"
        else:
            continue
        snaps_root = snapshots_root(path)
        snapshots = tuple(
            _listed(snap, "temporary" if snap.name.startswith(TMP_PREFIX) else "rollout_snapshot", None)
            for snap in sorted(snaps_root.iterdir() if snaps_root.is_dir() else [], reverse=True,
                               key=lambda p: (snapshot_sequence(p.name) or -1, p.name))
            if snap.name.startswith(TMP_PREFIX) or snapshot_sequence(snap.name) is not None)
        anchors.append(_listed(path, kind, step, skip=SNAPSHOTS_DIRNAME)._replace(snapshots=snapshots))
    return sorted(anchors, key=lambda a: (a.step is not None, a.step or 0), reverse=True)


def remove_stale_tmp_dirs(checkpoint_dir: str | Path, writer: StorageWriter = PLAIN_FILES) -> list[Path]:
    """Delete ``.tmp-*`` dirs a crash left behind, each named in a warning.

    Only the holder of the run directory's lock may call it (``runner.run`` does, at every start, also
    when the run is complete): a ``.tmp-`` dir is then certainly no live writer's.
    """
    import logging

    root = Path(checkpoint_dir)
    removed = []
    if not root.is_dir():
        return removed
    dirs = [root]
    for path in root.iterdir():
        if path.is_dir() and (path.name == BOOTSTRAP_DIRNAME or _STEP_DIR.match(path.name)):
            dirs.append(snapshots_root(path))
    for parent in dirs:
        if not parent.is_dir():
            continue
        for path in parent.iterdir():
            if path.name.startswith(TMP_PREFIX) and path.is_dir():
                writer.remove(path)
                removed.append(path)
                logging.getLogger(__name__).warning(
                    "removed a half-written checkpoint directory left by a crash: %s", path)
    return removed

"""Store: write-once manifest, digest-named records, every error names its file."""

from __future__ import annotations

import errno
import inspect
import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gym_patches.checkpoint.errors import CheckpointStoreError
from gym_patches.checkpoint.storage import FileSystemWriter, StorageWriter, StorageWriterSpec, build_writer
from gym_patches.config import GymConfigError, parse_gym_config
from gym_patches.checkpoint.store import (
    MANIFEST_NAME,
    WriteStopped,
    participant_dir,
    read_participant_state,
    write_participant_state,
)

PLAIN = FileSystemWriter()  # plain files: what a store writes through when a test is not about the writer

RECORDS = [
    {"episode_id": {"rollout_id": "r1", "attempt": 0}, "state": {"b": [1, 2], "a": "ünï"}},
    {"episode_id": {"rollout_id": "r2", "attempt": 3}, "state": None},
]


def test_round_trip_layout_and_manifest(tmp_path):
    manifest = write_participant_state(tmp_path, "agent", "agent_a", "ckpt-1", RECORDS, writer=PLAIN)
    directory = tmp_path / "gym" / "agent" / "agent_a"
    assert manifest.records_file == f"records-{manifest.records_sha256}.jsonl"
    assert manifest.record_count == 2
    assert sorted(p.name for p in directory.iterdir()) == sorted([MANIFEST_NAME, manifest.records_file])
    on_disk = json.loads((directory / MANIFEST_NAME).read_text())
    assert on_disk["schema_version"] == 1 and on_disk["checkpoint_id"] == "ckpt-1"
    # one JSON object per line, stable key order
    lines = (directory / manifest.records_file).read_text(encoding="utf-8").splitlines()
    assert lines[0].index('"a"') < lines[0].index('"b"')
    read_manifest, records = read_participant_state(tmp_path, "agent", "agent_a", "ckpt-1")
    assert read_manifest == manifest
    assert records == RECORDS


def test_instance_with_slash_nests(tmp_path):
    write_participant_state(tmp_path, "model", "shard0/replica-1", "c", [], writer=PLAIN)
    assert (tmp_path / "gym" / "model" / "shard0" / "replica-1" / MANIFEST_NAME).exists()
    manifest, records = read_participant_state(tmp_path, "model", "shard0/replica-1", "c")
    assert records == [] and manifest.record_count == 0


def test_same_content_again_returns_existing_manifest(tmp_path):
    first = write_participant_state(tmp_path, "agent", "a", "c1", RECORDS, writer=PLAIN)
    again = write_participant_state(tmp_path, "agent", "a", "c1", [dict(r) for r in RECORDS], writer=PLAIN)
    assert again == first
    files = list((tmp_path / "gym" / "agent" / "a").iterdir())
    assert len(files) == 2  # no temp files left behind


def test_different_content_for_existing_manifest_is_refused(tmp_path):
    write_participant_state(tmp_path, "agent", "a", "c1", RECORDS, writer=PLAIN)
    manifest_path = tmp_path / "gym" / "agent" / "a" / MANIFEST_NAME
    before = manifest_path.read_bytes()
    with pytest.raises(CheckpointStoreError, match="already records different content") as info:
        write_participant_state(tmp_path, "agent", "a", "c1", RECORDS[:1], writer=PLAIN)
    assert str(manifest_path) in str(info.value)
    assert manifest_path.read_bytes() == before
    _, records = read_participant_state(tmp_path, "agent", "a", "c1")
    assert records == RECORDS


def test_other_checkpoint_in_same_dir_is_refused(tmp_path):
    write_participant_state(tmp_path, "agent", "a", "c1", RECORDS, writer=PLAIN)
    with pytest.raises(CheckpointStoreError, match="already belongs to checkpoint 'c1'"):
        write_participant_state(tmp_path, "agent", "a", "c2", RECORDS, writer=PLAIN)


@pytest.mark.parametrize("instance", ["..", "../x", "a/../../b", "/abs", "", "a//b", "a\\b", "./a", "a/."])
def test_path_traversal_is_refused(tmp_path, instance):
    with pytest.raises(CheckpointStoreError, match="instance name"):
        write_participant_state(tmp_path, "agent", instance, "c1", RECORDS, writer=PLAIN)
    with pytest.raises(CheckpointStoreError, match="instance name"):
        read_participant_state(tmp_path, "agent", instance, "c1")
    assert not (tmp_path / "gym").exists() or not any((tmp_path / "gym").rglob("*.jsonl"))


def test_bad_kind_and_checkpoint_id(tmp_path):
    with pytest.raises(CheckpointStoreError, match="unknown participant kind 'environment'"):
        participant_dir(tmp_path, "environment", "a")
    with pytest.raises(CheckpointStoreError, match="checkpoint_id '../x'"):
        write_participant_state(tmp_path, "agent", "a", "../x", [], writer=PLAIN)


def test_unserialisable_record_publishes_nothing(tmp_path):
    with pytest.raises(CheckpointStoreError, match="record 1 is not JSON-serialisable"):
        write_participant_state(tmp_path, "agent", "a", "c1", [{"ok": 1}, {"bad": object()}], writer=PLAIN)
    with pytest.raises(CheckpointStoreError, match="record 0 is a list"):
        write_participant_state(tmp_path, "agent", "a", "c1", [[1]], writer=PLAIN)  # type: ignore[list-item]
    assert list((tmp_path / "gym" / "agent" / "a").iterdir()) == []


def test_stop_before_publish(tmp_path):
    with pytest.raises(WriteStopped):
        write_participant_state(tmp_path, "agent", "a", "c1", RECORDS, should_stop=lambda: True, writer=PLAIN)
    assert list((tmp_path / "gym" / "agent" / "a").iterdir()) == []


def test_flipped_byte_in_records_names_the_file(tmp_path):
    manifest = write_participant_state(tmp_path, "resources", "tools", "c1", RECORDS, writer=PLAIN)
    records_path = tmp_path / "gym" / "resources" / "tools" / manifest.records_file
    data = bytearray(records_path.read_bytes())
    data[5] ^= 0x01
    records_path.write_bytes(bytes(data))
    with pytest.raises(CheckpointStoreError) as info:
        read_participant_state(tmp_path, "resources", "tools", "c1")
    assert str(records_path) in str(info.value) and "sha256" in str(info.value)


def test_truncated_manifest_names_manifest(tmp_path):
    write_participant_state(tmp_path, "agent", "a", "c1", RECORDS, writer=PLAIN)
    manifest_path = tmp_path / "gym" / "agent" / "a" / MANIFEST_NAME
    raw = manifest_path.read_bytes()
    os.chmod(manifest_path, 0o644)
    manifest_path.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(CheckpointStoreError, match="manifest.json is not valid JSON") as info:
        read_participant_state(tmp_path, "agent", "a", "c1")
    assert str(manifest_path) in str(info.value)


def test_missing_manifest_and_missing_records(tmp_path):
    with pytest.raises(CheckpointStoreError, match=r"manifest\.json is missing"):
        read_participant_state(tmp_path, "agent", "a", "c1")
    manifest = write_participant_state(tmp_path, "agent", "a", "c1", RECORDS, writer=PLAIN)
    records_path = tmp_path / "gym" / "agent" / "a" / manifest.records_file
    records_path.unlink()
    with pytest.raises(CheckpointStoreError, match="is missing") as info:
        read_participant_state(tmp_path, "agent", "a", "c1")
    assert str(records_path) in str(info.value)


def _rewrite_manifest(tmp_path, where, changes):
    path = tmp_path / "gym" / where / MANIFEST_NAME
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"schema_version": 2}, "schema_version 2"),
        ({"kind": "model"}, "has kind 'model', expected 'agent'"),
        ({"instance": "other"}, "has instance 'other', expected 'a'"),
        ({"checkpoint_id": "c2"}, "has checkpoint_id 'c2', expected 'c1'"),
        ({"record_count": 5}, "holds 2 records"),
        ({"records_file": "records-" + "0" * 64 + ".jsonl"}, "does not match records_sha256"),
        ({"surprise": 1}, "surprise"),
    ],
)
def test_every_manifest_field_is_checked(tmp_path, changes, message):
    write_participant_state(tmp_path, "agent", "a", "c1", RECORDS, writer=PLAIN)
    path = _rewrite_manifest(tmp_path, "agent/a", changes)
    with pytest.raises(CheckpointStoreError, match=message) as info:
        read_participant_state(tmp_path, "agent", "a", "c1")
    assert "manifest.json" in str(info.value) or str(path.parent) in str(info.value)


def test_unparseable_line_with_matching_digest_names_file_and_line(tmp_path):
    # A records file whose digest matches but whose second line is not JSON.
    import hashlib

    directory = tmp_path / "gym" / "agent" / "a"
    directory.mkdir(parents=True)
    content = b'{"x":1}\n{not json\n'
    sha = hashlib.sha256(content).hexdigest()
    (directory / f"records-{sha}.jsonl").write_bytes(content)
    manifest = {
        "schema_version": 1, "kind": "agent", "instance": "a", "checkpoint_id": "c1",
        "records_file": f"records-{sha}.jsonl", "records_sha256": sha, "record_count": 2,
    }
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointStoreError, match="line 2 is not valid JSON") as info:
        read_participant_state(tmp_path, "agent", "a", "c1")
    assert f"records-{sha}.jsonl" in str(info.value)


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=20)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.dictionaries(st.text(max_size=8), _json, max_size=4), max_size=5))
def test_round_trip_property(tmp_path_factory, records):
    root = tmp_path_factory.mktemp("prop")
    manifest = write_participant_state(root, "resources", "r", "c1", records, writer=PLAIN)
    read_manifest, back = read_participant_state(root, "resources", "r", "c1")
    assert read_manifest == manifest and back == records
    assert write_participant_state(root, "resources", "r", "c1", records, writer=PLAIN) == manifest


def test_fragments_are_spliced_and_non_finite_floats_become_null(tmp_path):
    """A record's fragment is written as it is; NaN and infinity are written as null (documented)."""
    from pydantic import BaseModel

    from gym_patches.checkpoint.records import fragment, plain

    class World(BaseModel):
        names: list[str]
        score: float

    world = World(names=["b", "a"], score=float("nan"))
    record = {"episode_id": {"rollout_id": "r1", "attempt": 0}, "state": fragment(world)}
    assert plain(record)["state"] == {"names": ["b", "a"], "score": None}
    write_participant_state(tmp_path, "resources", "w", "c1", [record, {"episode_id": {}, "x": float("inf")}], writer=PLAIN)
    _, back = read_participant_state(tmp_path, "resources", "w", "c1")
    assert back == [plain(record), {"episode_id": {}, "x": None}]


# -- the storage-writer seam -------------------------------------------------------------
class RecordingWriter(FileSystemWriter):
    """Test-only: writes plain files and notes each call; fails the ``fail_on``-th file write with ``errno``."""

    def __init__(self, fail_on: int | None = None, code: int = errno.ENOSPC):
        self.paths: list[Path] = []
        self.calls: list[tuple[str, Path]] = []
        self.fail_on, self.code = fail_on, code

    def write(self, path, data):
        self.paths.append(path)
        self.calls.append(("write", Path(path)))
        if len(self.paths) == self.fail_on:
            raise OSError(self.code, os.strerror(self.code), str(path))
        super().write(path, data)

    def commit(self, src, dst, *, replace=True):
        self.calls.append(("commit" if replace else "commit-once", Path(dst)))
        super().commit(src, dst, replace=replace)

    def make_dirs(self, path):
        self.calls.append(("make_dirs", Path(path)))
        super().make_dirs(path)


def test_every_file_its_rename_and_its_directory_go_through_the_writer_passed_in(tmp_path):
    writer = RecordingWriter()
    manifest = write_participant_state(tmp_path, "agent", "a", "c1", RECORDS, writer=writer)
    directory = tmp_path / "gym" / "agent" / "a"
    assert [p.parent for p in writer.paths] == [directory, directory]
    assert "records.jsonl" in writer.paths[0].name and "manifest.json" in writer.paths[1].name
    assert [(op, p) for op, p in writer.calls if op != "write"] == [
        ("make_dirs", directory), ("commit", directory / manifest.records_file),
        ("commit-once", directory / MANIFEST_NAME)]  # the manifest is created once, never replaced
    assert sorted(p.name for p in directory.iterdir()) == sorted([MANIFEST_NAME, manifest.records_file])
    assert read_participant_state(tmp_path, "agent", "a", "c1")[1] == RECORDS


@pytest.mark.parametrize("fail_on, code, names", [
    (1, errno.ENOSPC, "records-"), (2, errno.EIO, MANIFEST_NAME)])
def test_a_failing_writer_names_the_file_and_publishes_nothing(tmp_path, fail_on, code, names):
    with pytest.raises(CheckpointStoreError) as raised:
        write_participant_state(tmp_path, "agent", "a", "c1", RECORDS, writer=RecordingWriter(fail_on=fail_on, code=code))
    directory = tmp_path / "gym" / "agent" / "a"
    assert f"cannot write {directory / names}" in str(raised.value)
    assert f"[Errno {code}] {os.strerror(code)}" in str(raised.value)
    assert not (directory / MANIFEST_NAME).exists()
    assert [p for p in directory.iterdir() if p.name.startswith(".")] == []  # no temp file left


def test_a_store_needs_a_writer_and_the_writer_is_an_interface(tmp_path):
    with pytest.raises(TypeError, match="writer"):
        write_participant_state(tmp_path, "agent", "a", "c1", RECORDS)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        StorageWriter()  # type: ignore[abstract] - an interface: the file system one is FileSystemWriter


class CountingWriter(FileSystemWriter):
    """A writer a config can name: plain files, counted, with a keyword argument to refuse."""

    def __init__(self, label: str = "x"):
        if not label:
            raise ValueError("label must not be empty")
        self.label = label


WRITER_PATH = f"{__name__}:CountingWriter"


def test_a_writer_named_in_config_is_built_anew_for_each_process():
    spec = StorageWriterSpec(class_path=WRITER_PATH, kwargs={"label": "run"})
    built = build_writer(spec)
    assert isinstance(built, CountingWriter) and built.label == "run"
    assert build_writer(spec) is not built  # each build is a new writer (each process counts its own)
    assert type(build_writer(None)) is FileSystemWriter  # null: plain files


@pytest.mark.parametrize("spec, says", [
    ({"class_path": "no_such_module_here:W"}, "cannot import storage writer 'no_such_module_here:W'"),
    ({"class_path": "gym_patches.checkpoint.storage"}, "must look like 'package.module:ClassName'"),
    ({"class_path": "gym_patches.checkpoint.storage:StorageWriterSpec"}, "is not a StorageWriter subclass"),
    ({"class_path": "gym_patches.checkpoint.storage:Nope"}, "has no attribute 'Nope'"),
    ({"class_path": WRITER_PATH, "kwargs": {"label": ""}}, "refused kwargs {'label': ''}: label must not be empty"),
    ({"class_path": WRITER_PATH, "kwargs": {"colour": 1}}, "refused kwargs {'colour': 1}"),
    ({"class_path": WRITER_PATH, "extra": 1}, "Extra inputs are not permitted"),
])
def test_a_bad_writer_spec_is_refused_naming_the_key_in_gym_config(spec, says):
    with pytest.raises(GymConfigError) as raised:
        parse_gym_config({"checkpoint": {"storage_writer": spec}})
    assert "checkpoint.storage_writer" in str(raised.value) and says in str(raised.value)


def test_gym_config_carries_the_writer_spec():
    cfg = parse_gym_config({"checkpoint": {"storage_writer": {"class_path": WRITER_PATH, "kwargs": {"label": "g"}}}})
    assert cfg.checkpoint.storage_writer == StorageWriterSpec(class_path=WRITER_PATH, kwargs={"label": "g"})


def test_the_store_reads_no_environment_and_imports_no_testing_or_rl_module():
    import gym_patches.checkpoint.store as store

    source = inspect.getsource(store)
    assert "environ" not in source and "getenv" not in source
    assert "gym_patches.testing" not in source and "nemo_rl" not in source

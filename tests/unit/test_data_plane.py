"""Data plane store: sealed samples by rollout id, saved as digest-checked JSONL."""

from __future__ import annotations

import hashlib

import pytest

from nemo_rl.experience.data_plane import DATA_PLANE_FILE, DataPlaneError, DataPlaneStore
from nemo_rl.experience.sample import ModelCall, RolloutSample


def _sample(group="grp0", g=0, rid=None, reward=1.0, tokens=(1, 2)):
    return RolloutSample(
        rollout_id=rid or f"{group}_g{g}_a{'0' * 31}{g}",
        group_id=group,
        generation_index=g,
        reward=reward,
        prompt_id="p",
        calls=[
            ModelCall(
                prompt_token_ids=[5, 6],
                generation_token_ids=list(tokens),
                generation_log_probs=[-0.5] * len(tokens),
            )
        ],
    )


def test_put_get_and_duplicate():
    store = DataPlaneStore()
    s = _sample()
    store.put(s)
    assert store.get(s.rollout_id) == s and s.rollout_id in store and len(store) == 1
    with pytest.raises(DataPlaneError, match=s.rollout_id):
        store.put(_sample(reward=0.0))
    with pytest.raises(DataPlaneError, match="nope"):
        store.get("nope")


def test_pop_group_orders_by_generation_and_removes():
    store = DataPlaneStore()
    for g in (2, 0, 1):
        store.put(_sample(g=g))
    store.put(_sample(group="other", g=0))
    popped = store.pop_group("grp0")
    assert [s.generation_index for s in popped] == [0, 1, 2]
    assert len(store) == 1 and store.pop_group("grp0") == []


def test_pop_group_refuses_two_samples_for_one_generation():
    store = DataPlaneStore()
    store.put(_sample(g=0, rid="grp0_g0_aaa"))
    store.put(_sample(g=0, rid="grp0_g0_abb"))
    with pytest.raises(DataPlaneError, match="generation 0"):
        store.pop_group("grp0")


def test_discard_ignores_unknown():
    store = DataPlaneStore()
    a, b = _sample(g=0), _sample(g=1)
    store.put(a)
    store.put(b)
    assert store.discard([a.rollout_id, "missing"]) == 1
    assert store.rollout_ids() == {b.rollout_id}


def test_save_load_round_trip(tmp_path):
    store = DataPlaneStore()
    for g in range(3):
        store.put(_sample(g=g, reward=g / 2, tokens=range(g + 1)))
    meta = store.save(tmp_path / "dp")
    data = (tmp_path / "dp" / DATA_PLANE_FILE).read_bytes()
    assert meta == {"file": DATA_PLANE_FILE, "sha256": hashlib.sha256(data).hexdigest(), "count": 3}
    loaded = DataPlaneStore.load(tmp_path / "dp", meta["sha256"], expected_count=3)
    assert {s.rollout_id: s for s in loaded} == {s.rollout_id: s for s in store}
    # Saving is deterministic: same content, same digest.
    assert loaded.save(tmp_path / "dp2")["sha256"] == meta["sha256"]


def test_empty_store_round_trip(tmp_path):
    meta = DataPlaneStore().save(tmp_path)
    assert meta["count"] == 0
    assert len(DataPlaneStore.load(tmp_path, meta["sha256"])) == 0


def test_load_names_the_file_on_digest_mismatch(tmp_path):
    store = DataPlaneStore()
    store.put(_sample())
    meta = store.save(tmp_path)
    path = tmp_path / DATA_PLANE_FILE
    raw = bytearray(path.read_bytes())
    raw[10] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(DataPlaneError, match=f"{path}.*sha256"):
        DataPlaneStore.load(tmp_path, meta["sha256"])


def test_load_names_the_file_when_missing_or_wrong_count(tmp_path):
    with pytest.raises(DataPlaneError, match=f"{tmp_path / DATA_PLANE_FILE}: missing"):
        DataPlaneStore.load(tmp_path, "0" * 64)
    store = DataPlaneStore()
    store.put(_sample())
    meta = store.save(tmp_path)
    with pytest.raises(DataPlaneError, match="expected 2"):
        DataPlaneStore.load(tmp_path, meta["sha256"], expected_count=2)


def test_load_names_line_of_a_bad_record(tmp_path):
    good = _sample().model_dump_json()
    data = (good + "\n" + '{"rollout_id": 3}\n').encode()
    (tmp_path / DATA_PLANE_FILE).write_bytes(data)
    with pytest.raises(DataPlaneError, match=f"{DATA_PLANE_FILE}:2"):
        DataPlaneStore.load(tmp_path, hashlib.sha256(data).hexdigest())
    dup = (good + "\n" + good + "\n").encode()
    (tmp_path / DATA_PLANE_FILE).write_bytes(dup)
    with pytest.raises(DataPlaneError, match=f"{DATA_PLANE_FILE}:2: rollout .* already"):
        DataPlaneStore.load(tmp_path, hashlib.sha256(dup).hexdigest())

"""A streaming step (``open_step``, ``add`` whole groups as they complete, ``finish``) is the same
optimizer step as one ``train_step`` over all its groups, and it rejects what would break that.

Real tiny Hugging Face model (``tests/model_fixtures``), real AdamW, real samples: several prompt
groups, multi-call rollouts, one group without signal, off-policy generation logprobs.
"""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from nemo_rl.algorithms.grpo import GRPOStreamingStep, GRPOTrainer
from nemo_rl.algorithms.grpo_config import GRPOConfig, LossConfig, PolicyConfig
from nemo_rl.algorithms.recording_trainer import RecordingTrainer
from nemo_rl.experience.sample import ModelCall, RolloutSample
from nemo_rl.models.policy import load_policy
from tests.model_fixtures import tiny_qwen_dir

torch.set_num_threads(1)
# Every metric that must come out the same; train_s (time) and num_adds (the point of the test) differ.
SAME_METRICS = ("step", "weight_version", "loss", "reward_mean", "reward_std", "reward_max", "advantage_abs_mean",
                "num_rollouts", "num_groups", "groups_with_signal", "num_sequences", "num_trained_sequences",
                "num_gen_tokens", "mean_gen_tokens", "calls_per_rollout", "pg_clip_frac", "ratio_mean", "kl_ref",
                "approx_kl_old", "gen_logprob_abs_err", "max_weight_version_lag", "grad_norm", "lr")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_qwen_dir(tmp_path_factory.mktemp("tiny"))


def _trainer(model_dir, kl=0.0, use_gen_lp=False) -> GRPOTrainer:
    # lr 1e-4: Adam divides by sqrt(v) + 1e-8, so an entry whose gradient is ~1e-8 turns float32 rounding
    # of the gradient (~1e-8 absolute here, from other micro-batch shapes and summation order) into an
    # update difference of up to ~lr/4 * 1e-8/1e-8. At 1e-4 that stays well under the 1e-6 checked,
    # while any real difference in the update (wrong token weighting, a group lost) moves weights ~lr.
    torch.manual_seed(0)
    cfg = PolicyConfig(device="cpu", max_seq_len=128, learning_rate=1e-4, train_micro_batch_size=4)
    policy = load_policy(str(model_dir), "float32", "cpu", cfg.max_seq_len)
    grpo = GRPOConfig(seed=0, use_generation_logprobs=use_gen_lp)
    return GRPOTrainer(cfg, LossConfig(reference_policy_kl_penalty=kl), grpo, policy)


def _groups(trainer, seed, n_groups=5, per_group=3, versions=None) -> list[list[RolloutSample]]:
    """Prompt groups as the data plane hands them over: each rollout's calls carry the generation
    worker's tokens and logprobs (here the policy's own, perturbed: a slightly older policy)."""
    rng = random.Random(seed)
    groups = []
    for gi in range(n_groups):
        prompt = [rng.randrange(3, 300) for _ in range(rng.randint(2, 6))]
        group = []
        for k in range(per_group):
            calls = []
            for ci in range(1 + k % 2):  # every other rollout makes a second model call (after a tool turn)
                p = prompt + [rng.randrange(3, 300) for _ in range(3 * ci)]
                gen = [rng.randrange(3, 300) for _ in range(rng.randint(1, 9))]
                lp = [x + rng.gauss(0.0, 0.2) for x in trainer.policy.token_logprobs(p, gen).tolist()]
                calls.append(ModelCall(prompt_token_ids=p, generation_token_ids=gen, generation_log_probs=lp,
                                       weight_version=versions[gi] if versions else trainer.weight_version))
            reward = 1.0 if gi == 2 else float(rng.random() > 0.5) + rng.random()  # group 2: no signal
            group.append(RolloutSample(rollout_id=f"s{seed}_g{gi}_{k}", group_id=f"s{seed}_g{gi}",
                                       generation_index=k, reward=reward, calls=calls))
        groups.append(group)
    return groups


def _flat(groups):
    return [s for g in groups for s in g]


def _params(trainer):
    return {k: v.clone() for k, v in trainer.state_dict_for_refit().items()}


def _assert_same_step(ma, mb, pa, pb):
    for k in SAME_METRICS:
        assert mb[k] == pytest.approx(ma[k], rel=1e-5, abs=1e-7), k
    assert pa.keys() == pb.keys()
    for k in pa:
        assert torch.allclose(pa[k], pb[k], atol=1e-6, rtol=0), (k, float((pa[k] - pb[k]).abs().max()))


@pytest.mark.parametrize("kl", [0.0, 0.3], ids=["no_kl", "kl"])
@pytest.mark.parametrize("use_gen_lp", [False, True], ids=["recomputed_old_lp", "generation_old_lp"])
def test_streamed_step_equals_one_train_step(model_dir, kl, use_gen_lp):
    whole, streamed = _trainer(model_dir, kl, use_gen_lp), _trainer(model_dir, kl, use_gen_lp)
    start = _params(whole)
    assert all(torch.equal(start[k], v) for k, v in _params(streamed).items())
    # Two steps: Adam's first update hardly depends on the gradient's scale, the second one does
    # (and with KL the second step is the one with a non-zero KL term).
    for seed, versions in ((1, None), (2, [1, 1, 0, 1, 1])):
        groups = _groups(whole, seed, versions=versions)
        ma = whole.train_step(_flat(groups))
        step = streamed.open_step()
        assert isinstance(step, GRPOStreamingStep)
        step.add(_flat(groups[:2]))
        step.add(_flat(groups[2:]))  # holds the oldest weight version and the group without signal
        mb = step.finish()
        assert ma["num_adds"] == 1 and mb["num_adds"] == 2
        _assert_same_step(ma, mb, _params(whole), _params(streamed))
    assert mb["max_weight_version_lag"] == 1.0 and mb["num_groups"] == 5 and mb["groups_with_signal"] == 4
    assert mb["num_trained_sequences"] < mb["num_sequences"] or kl > 0
    if kl:
        assert mb["kl_ref"] > 0 and streamed.reference is not None
    if use_gen_lp:
        assert mb["ratio_mean"] != pytest.approx(1.0, abs=1e-3)  # really off-policy
    # the step trained: weights moved (so equality above is not two untouched models)
    assert any(not torch.allclose(start[k], v, atol=1e-5) for k, v in _params(streamed).items())


def test_one_group_per_add_from_worker_threads(model_dir):
    """The controller adds from worker threads as groups complete; adds may even overlap."""
    whole, streamed = _trainer(model_dir, kl=0.1), _trainer(model_dir, kl=0.1)
    groups = _groups(whole, 3)
    ma = whole.train_step(_flat(groups))
    step = streamed.open_step()
    with ThreadPoolExecutor(max_workers=3) as pool:
        for f in [pool.submit(step.add, g) for g in groups]:
            f.result()
    mb = step.finish()
    assert mb["num_adds"] == len(groups)
    _assert_same_step(ma, mb, _params(whole), _params(streamed))


def test_step_rules_name_what_is_wrong(model_dir):
    trainer = _trainer(model_dir)
    groups = _groups(trainer, 4, n_groups=3)
    before = _params(trainer)
    step = trainer.open_step()
    with pytest.raises(ValueError, match="finish: nothing was added"):
        step.finish()
    with pytest.raises(ValueError, match="at least one RolloutSample"):
        step.add([])
    with pytest.raises(RuntimeError, match="already open"):
        trainer.open_step()
    with pytest.raises(RuntimeError, match="already open"):
        trainer.train_step(_flat(groups))
    with pytest.raises(RuntimeError, match="streaming step is open"):
        trainer.load("/nonexistent")
    step.add(groups[0][:2])
    with pytest.raises(ValueError, match=r"group 's4_g0' was already added.*split"):
        step.add(groups[0][2:] + groups[1])  # the rest of a group already (partly) in this step
    with pytest.raises(ValueError, match="group 's4_g0' was already added"):
        step.add(groups[0][:2])
    # a rejected add changed nothing: its other group can still come, and the step finishes normally
    too_long = groups[2][0].model_copy(deep=True)
    too_long.calls[0].prompt_token_ids = [5] * 200
    with pytest.raises(ValueError, match=r"s4_g2_0.*max_seq_len"):
        step.add([too_long, *groups[2][1:]])
    step.add(groups[1])
    step.add(groups[2])
    m = step.finish()
    assert m["num_groups"] == 3 and m["num_adds"] == 3 and trainer.weight_version == 1
    assert any(not torch.equal(before[k], v) for k, v in _params(trainer).items())
    with pytest.raises(RuntimeError, match="add: this step is finished"):
        step.add(groups[1])
    with pytest.raises(RuntimeError, match="finish: this step is finished"):
        step.finish()
    trainer.open_step().abort()  # the trainer takes a new step once the old one is finished


def test_abort_drops_the_step_and_frees_the_trainer(model_dir):
    trainer = _trainer(model_dir, kl=0.2)
    groups = _groups(trainer, 5, n_groups=2)
    before = _params(trainer)
    step = trainer.open_step()
    step.add(groups[0])
    assert any(p.grad is not None for p in trainer.policy.parameters())
    step.abort()
    assert all(p.grad is None for p in trainer.policy.parameters())
    assert trainer.step == 0 and trainer.weight_version == 0
    assert all(torch.equal(before[k], v) for k, v in _params(trainer).items())
    with pytest.raises(RuntimeError, match="add: this step is aborted"):
        step.add(groups[1])
    # the aborted add left nothing behind: the next step equals a fresh trainer's
    m = trainer.train_step(_flat(groups))
    fresh = _trainer(model_dir, kl=0.2)
    mf = fresh.train_step(_flat(groups))
    _assert_same_step(mf, m, _params(fresh), _params(trainer))


def test_train_step_errors_leave_no_step_open(model_dir):
    trainer = _trainer(model_dir)
    with pytest.raises(ValueError, match="at least one"):
        trainer.train_step([])
    bad = _flat(_groups(trainer, 6, n_groups=1))
    bad[0].calls[0].prompt_token_ids = [5] * 200
    with pytest.raises(ValueError, match="max_seq_len"):
        trainer.train_step(bad)
    assert trainer.train_step(_flat(_groups(trainer, 6, n_groups=1)))["weight_version"] == 1


def test_a_failing_add_closes_the_step_and_clears_its_gradients(model_dir):
    """A failure mid-backward leaves partial sums: the step is closed (naming the failure), the trainer free."""
    trainer = _trainer(model_dir)
    groups = _groups(trainer, 7, n_groups=2, per_group=6)  # several micro-batches per group
    step = trainer.open_step()
    step.add(groups[0])
    real = trainer.policy.sequence_logprobs
    backwards = []

    def fails_on_second_training_forward(ids, temperature=1.0):
        if torch.is_grad_enabled():
            backwards.append(len(ids))
            if len(backwards) == 2:  # the add's first micro-batch is already in the gradients
                raise RuntimeError("device lost")
        return real(ids, temperature)

    trainer.policy.sequence_logprobs = fails_on_second_training_forward
    with pytest.raises(RuntimeError, match="device lost"):
        step.add(groups[1])
    trainer.policy.sequence_logprobs = real
    assert len(backwards) == 2
    assert all(p.grad is None for p in trainer.policy.parameters())
    with pytest.raises(RuntimeError, match=r"finish: this step is failed in add \(RuntimeError: device lost\)"):
        step.finish()
    assert trainer.train_step(_flat(groups))["weight_version"] == 1


# ----- the recording fake follows the same rules -----------------------------------
def test_recording_trainer_streaming_step(tmp_path, model_dir):
    trainer = _trainer(model_dir)
    groups = _groups(trainer, 8, n_groups=3)
    one, streamed = RecordingTrainer(tmp_path / "one"), RecordingTrainer(tmp_path / "streamed")
    one.train_step(_flat(groups))
    step = streamed.open_step()
    with pytest.raises(ValueError, match="RecordingStep.finish: nothing was added"):
        step.finish()
    with pytest.raises(RuntimeError, match="RecordingTrainer.open_step: a step is already open"):
        streamed.open_step()
    step.add(groups[2])
    t = threading.Thread(target=step.add, args=(groups[0],))
    t.start()
    t.join()
    with pytest.raises(ValueError, match="group 's8_g2' was already added"):
        step.add(groups[2][:1])
    assert streamed.batches == []  # nothing recorded before finish
    m = step.finish()
    assert m == {"loss": 0.0, "num_samples": 6.0}
    step2 = streamed.open_step()
    step2.add(groups[1])
    step2.finish()
    with pytest.raises(RuntimeError, match="RecordingStep.add: this step is finished"):
        step2.add(groups[1])
    # step 1's batch is the concatenation of its adds, recorded like a train_step's
    ref = RecordingTrainer(tmp_path / "ref")
    ref.train_step(groups[2] + groups[0])
    assert streamed.batches[0] == ref.batches[0]
    assert streamed.batches[0]["groups"] == ["s8_g0", "s8_g2"] and streamed.weight_version == 2
    assert (tmp_path / "streamed" / "trained_batches.jsonl").read_text().count("\n") == 2
    with pytest.raises(ValueError, match="at least one"):
        one.train_step([])
    assert one.train_step(groups[0])["num_samples"] == 3.0 and one.weight_version == 2

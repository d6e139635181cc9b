"""The Hugging Face policy (sampling, scoring), the GRPO trainer's step and HF-format checkpoint,
the embedded model's cache, model-source errors, and the warm start."""

import json
import time
from pathlib import Path

import pytest
import torch

from nemo_rl.algorithms.grpo import GRPOTrainer
from nemo_rl.algorithms.grpo_config import GRPOConfig, LossConfig, PolicyConfig, TinyModelRecipe
from nemo_rl.algorithms.warm_start import simulate_rows, warm_start
from nemo_rl.experience.sample import ModelCall, RolloutSample
from nemo_rl.models.policy import load_policy, resolve_device, resolve_dtype, resolve_model_source
from tests.model_fixtures import SMALL, llama_dir, tiny_qwen_dir

torch.set_num_threads(1)
DATA = Path(__file__).resolve().parents[2] / "examples" / "data" / "workplace_train.jsonl"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_qwen_dir(tmp_path_factory.mktemp("tiny"))


def _policy(model_dir, max_seq_len=128):
    return load_policy(str(model_dir), "float32", "cpu", max_seq_len).eval()


@pytest.fixture
def policy(model_dir):
    return _policy(model_dir)


def test_sample_logprobs_match_recomputed(policy):
    g = torch.Generator().manual_seed(0)
    prompt = [1, 5, 7, 9]
    out = policy.sample_batch([prompt], [20], [0.8], generator=g)[0]
    assert len(out.token_ids) == len(out.logprobs) >= 1
    re = policy.token_logprobs(prompt, out.token_ids, temperature=0.8)
    assert torch.allclose(re, torch.tensor(out.logprobs), atol=1e-4)
    # scored at another temperature they differ: the temperature really is part of the logprob
    assert not torch.allclose(policy.token_logprobs(prompt, out.token_ids, 1.3), torch.tensor(out.logprobs), atol=1e-3)


def test_batched_left_padded_sampling_matches_single(policy):
    g = torch.Generator().manual_seed(1)
    prompts = [[3], [4, 5, 6, 7, 8, 9, 10], [11, 12, 13]]
    temps = [1.0, 0.5, 1.3]
    outs = policy.sample_batch(prompts, [12, 5, 9], temps, generator=g, top_k=[3, 0, 2])
    for p, o, t, k, n in zip(prompts, outs, temps, [3, 0, 2], [12, 5, 9]):
        assert len(o.token_ids) == n or o.finish_reason == "stop"
        assert torch.allclose(policy.token_logprobs(p, o.token_ids, t), torch.tensor(o.logprobs), atol=1e-4)
        assert len(o.top) == (len(o.token_ids) if k else 0)
        for (tok, lp), top in zip(zip(o.token_ids, o.logprobs), o.top):
            assert len(top) == k and top[0][1] >= top[-1][1]
            assert top[0][1] >= lp - 1e-6  # the best token is at least as likely as the sampled one


def test_greedy_is_deterministic_and_stops_at_the_eos(model_dir):
    policy = _policy(model_dir)
    a = policy.sample_batch([[1, 2, 3]], [15], [0.0])[0]
    assert a.token_ids == policy.sample_batch([[1, 2, 3]], [15], [0.0])[0].token_ids
    policy.stop_ids = frozenset({a.token_ids[3]})  # any emitted token can be made the stop token
    b = policy.sample_batch([[1, 2, 3], [4]], [15, 15], [0.0, 0.0])[0]
    assert b.finish_reason == "stop" and b.token_ids == a.token_ids[: a.token_ids.index(a.token_ids[3]) + 1]


def test_length_guards(policy):
    with pytest.raises(ValueError, match="max_seq_len"):
        policy.sample_batch([[1] * 128], [5], [1.0])
    out = policy.sample_batch([[1] * 120], [50], [1.0])[0]
    assert len(out.token_ids) <= 8  # capped so prompt + generation fits
    with pytest.raises(ValueError, match="outside"):
        policy.token_logprobs([1, 2], [policy.vocab_size + 5])


def test_device_and_dtype_resolution():
    assert resolve_device("cpu").type == "cpu"
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cuda"):
            resolve_device("cuda")
    with pytest.raises(ValueError, match="dtype"):
        PolicyConfig(dtype="int8")
    with pytest.raises(ValueError, match="policy.dtype"):
        resolve_dtype("int8")
    assert resolve_dtype("bfloat16") == torch.bfloat16


def test_recipe_and_unknown_keys_are_checked():
    with pytest.raises(ValueError, match="head_dim"):
        TinyModelRecipe(head_dim=16)  # vLLM's CPU attention rejects head_dim 16
    with pytest.raises(ValueError, match="num_kv_heads"):
        TinyModelRecipe(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="extra"):
        PolicyConfig(hidden_size=32)  # moved to policy.tiny_model


def test_unknown_key_is_named_by_the_config_loader():
    from nemo_rl.algorithms.single_controller_utils.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="policy.tiny_model.hiden_size"):
        load_config(None, ["policy.tiny_model.hiden_size=64"])
    cfg = load_config(None, ["policy.tiny_model.hidden_size=64", "policy.dtype=bfloat16"])
    assert cfg.policy.tiny_model.hidden_size == 64 and cfg.policy.dtype == "bfloat16"


# ----- model sources ------------------------------------------------------------
def test_unfetchable_hub_id_fails_fast_naming_the_setting(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"policy.model_name='nobody-xyz/no-such-model-123'"):
        resolve_model_source("nobody-xyz/no-such-model-123", probe_timeout_s=5)
    assert time.monotonic() - t0 < 30
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE"):
        resolve_model_source("Qwen/Qwen3-0.6B")
    with pytest.raises(ValueError, match="no such directory"):
        resolve_model_source(str(tmp_path / "missing" / "dir"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="config.json"):
        resolve_model_source(str(tmp_path / "empty"))


def test_another_architecture_loads_and_samples(tmp_path):
    d = llama_dir(tmp_path / "llama")
    assert resolve_model_source(str(d)) == str(d)
    p = load_policy(str(d), "float32", "cpu", 256)
    assert type(p.model).__name__ == "LlamaForCausalLM"
    assert p.stop_ids == {p.tokenizer.convert_tokens_to_ids("<|eot_id|>")}
    out = p.sample_batch([[1, 2, 3]], [6], [1.0])[0]
    assert torch.allclose(p.token_logprobs([1, 2, 3], out.token_ids), torch.tensor(out.logprobs), atol=1e-4)


# ----- trainer ----------------------------------------------------------------
def _trainer(model_dir, lr=3e-3, **loss):
    cfg = PolicyConfig(device="cpu", max_seq_len=128, learning_rate=lr)
    return GRPOTrainer(cfg, LossConfig(**loss), GRPOConfig(seed=0), _policy(model_dir))


def _samples(trainer, prompt, good, bad):
    calls = lambda gen: [ModelCall(prompt_token_ids=prompt, generation_token_ids=gen,  # noqa: E731
                                   generation_log_probs=trainer.policy.token_logprobs(prompt, gen).tolist())]
    return [
        RolloutSample(rollout_id="g_0", group_id="g", generation_index=0, reward=1.0, calls=calls(good)),
        RolloutSample(rollout_id="g_1", group_id="g", generation_index=1, reward=0.0, calls=calls(bad)),
    ]


def test_train_step_moves_logprobs_by_advantage_sign(model_dir):
    trainer = _trainer(model_dir)
    prompt, good, bad = [5, 6, 7], [8, 9, 2], [10, 11, 2]
    before_g = trainer.policy.token_logprobs(prompt, good).sum()
    before_b = trainer.policy.token_logprobs(prompt, bad).sum()
    for _ in range(3):
        m = trainer.train_step(_samples(trainer, prompt, good, bad))
    assert trainer.weight_version == 3 and trainer.step == 3
    assert trainer.policy.token_logprobs(prompt, good).sum() > before_g + 0.1
    assert trainer.policy.token_logprobs(prompt, bad).sum() < before_b - 0.1
    assert m["reward_mean"] == 0.5 and m["num_sequences"] == 2
    assert m["gen_logprob_abs_err"] < 1e-4
    assert {"loss", "train_s", "grad_norm", "pg_clip_frac"} <= m.keys()


def test_zero_signal_batch_leaves_weights_alone(model_dir):
    trainer = _trainer(model_dir)
    s = _samples(trainer, [5, 6], [7, 2], [8, 2])
    for x in s:
        x.reward = 1.0
    before = {k: v.clone() for k, v in trainer.state_dict_for_refit().items()}
    m = trainer.train_step(s)
    assert m["num_trained_sequences"] == 0 and trainer.weight_version == 1
    assert all(torch.equal(before[k], v) for k, v in trainer.state_dict_for_refit().items())


def test_train_step_rejects_bad_samples(model_dir):
    trainer = _trainer(model_dir)
    with pytest.raises(ValueError, match="at least one"):
        trainer.train_step([])
    s = _samples(trainer, [1, 2], [3], [4])
    s[0].calls[0].prompt_token_ids = [1] * 200
    with pytest.raises(ValueError, match="g_0.*max_seq_len"):
        trainer.train_step(s)


def test_kl_reference_is_frozen_and_used(model_dir):
    trainer = _trainer(model_dir, reference_policy_kl_penalty=0.5)
    m1 = trainer.train_step(_samples(trainer, [5, 6], [7, 2], [8, 2]))
    assert trainer.reference is not None and m1["kl_ref"] == pytest.approx(0.0, abs=1e-6)
    m2 = trainer.train_step(_samples(trainer, [5, 6], [7, 2], [8, 2]))
    assert m2["kl_ref"] > 0
    assert not any(p.requires_grad for p in trainer.reference.parameters())


def test_checkpoint_is_a_hugging_face_model_and_round_trips(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trainer = _trainer(model_dir, reference_policy_kl_penalty=0.1)
    trainer.train_step(_samples(trainer, [5, 6], [7, 2], [8, 2]))
    trainer.save(tmp_path / "step_1", dataloader_state={"epoch": 0, "position": 8})
    saved = trainer.state_dict_for_refit()
    d = tmp_path / "step_1"
    assert {"config.json", "model.safetensors", "tokenizer.json", "optimizer.pt", "rng.pt",
            "trainer_state.json"} <= {p.name for p in d.iterdir()}
    assert json.loads((d / "trainer_state.json").read_text())["step"] == 1
    # loadable as a plain Hugging Face model with the same weights
    hf = AutoModelForCausalLM.from_pretrained(d)
    assert all(torch.equal(saved[k], v) for k, v in hf.state_dict().items())
    assert AutoTokenizer.from_pretrained(d).get_vocab() == trainer.tokenizer.get_vocab()

    other = _trainer(model_dir, reference_policy_kl_penalty=0.1)
    assert other.load(d) == {"epoch": 0, "position": 8}
    assert other.step == 1 and other.weight_version == 1
    assert all(torch.equal(saved[k], v) for k, v in other.state_dict_for_refit().items())
    # same next step from both: optimizer moments and reference came back too
    s = _samples(trainer, [5, 6], [7, 2], [8, 2])
    trainer.train_step(s)
    other.train_step(s)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(trainer.state_dict_for_refit().values(),
                                                               other.state_dict_for_refit().values()))


def test_a_trainer_built_from_a_step_skips_its_weights_only_until_they_change(model_dir, tmp_path, monkeypatch):
    """``weights_from``: a load of the directory the policy came from reads no weights while no step
    changed them; after a step (or from another directory) it reads them, and the weights are the step's."""
    trainer = _trainer(model_dir)
    trainer.train_step(_samples(trainer, [5, 6], [7, 2], [8, 2]))
    trainer.save(tmp_path / "step_1")
    saved = trainer.state_dict_for_refit()
    reads = []
    real = GRPOTrainer._load_weights
    monkeypatch.setattr(GRPOTrainer, "_load_weights", lambda self, d: (reads.append(d.name), real(self, d)))

    cfg = PolicyConfig(device="cpu", max_seq_len=128, learning_rate=3e-3)
    restored = GRPOTrainer(cfg, LossConfig(), GRPOConfig(seed=0), _policy(tmp_path / "step_1"),
                           weights_from=tmp_path / "step_1")
    restored.load(tmp_path / "step_1")
    assert reads == [] and restored.weight_version == 1
    restored.train_step(_samples(restored, [5, 6], [7, 2], [8, 2]))
    assert any(not torch.equal(saved[k], v) for k, v in restored.state_dict_for_refit().items())
    restored.load(tmp_path / "step_1")  # the step moved the weights: read again
    assert reads == ["step_1"]
    assert all(torch.equal(saved[k], v) for k, v in restored.state_dict_for_refit().items())
    restored.load(tmp_path / "step_1")  # unchanged since that load
    assert reads == ["step_1"]


def test_load_rejects_incomplete_or_foreign_checkpoints(model_dir, tmp_path):
    trainer = _trainer(model_dir)
    with pytest.raises(FileNotFoundError, match="trainer_state.json"):
        trainer.load(tmp_path)
    trainer.save(tmp_path / "ck")
    bigger = tiny_qwen_dir(tmp_path / "bigger", hidden_size=96)
    foreign = GRPOTrainer(PolicyConfig(device="cpu"), LossConfig(), GRPOConfig(), _policy(bigger))
    with pytest.raises(ValueError, match="hidden_size"):
        foreign.load(tmp_path / "ck")
    other_tok = tiny_qwen_dir(tmp_path / "othertok", corpus=["completely other words here"])
    with pytest.raises(ValueError, match="vocab_size|tokenizer"):
        GRPOTrainer(PolicyConfig(device="cpu"), LossConfig(), GRPOConfig(), _policy(other_tok)).load(tmp_path / "ck")


# ----- embedded default: built once, cached by recipe ------------------------------
@pytest.mark.skipif(not DATA.exists(), reason="examples/data not generated")
def test_embedded_model_is_cached_by_recipe(tmp_path):
    from nemo_rl.algorithms.embedded_model import ensure_pretrained

    rows = [json.loads(l) for l in DATA.read_text().splitlines()[:12]]
    cfg = PolicyConfig(device="cpu", cache_dir=str(tmp_path), tiny_model=TinyModelRecipe(**SMALL))
    cfg.warm_start.steps, cfg.warm_start.batch_size = 3, 4
    logs: list[str] = []
    first = ensure_pretrained(cfg, rows, seed=0, log=logs.append, progress=False)
    assert any("trained a" in line for line in logs) and any("Warm start done" in line for line in logs)
    logs.clear()
    again = ensure_pretrained(cfg, rows, seed=0, log=logs.append, progress=False)
    assert again == first and logs == [f"Embedded model: reusing the cached warm start (3 steps) in {first}"]
    # a different warm start reuses the tokenizer and init, and is a new entry
    cfg.warm_start.steps = 4
    logs.clear()
    third = ensure_pretrained(cfg, rows, seed=0, log=logs.append, progress=False)
    assert third != first and any("reusing the cached tokenizer" in line for line in logs)
    p = load_policy(str(third), "float32", "cpu")
    assert type(p.model).__name__ == "Qwen3ForCausalLM" and p.model.config.head_dim == 32


# ----- warm start -------------------------------------------------------------
@pytest.mark.skipif(not DATA.exists(), reason="examples/data not generated")
def test_warm_start_learns_the_demonstrations(tmp_path):
    from nemo_rl.models.tiny_model import ensure_base

    rows = [json.loads(l) for l in DATA.read_text().splitlines()[:16]]
    convs = simulate_rows(rows)
    assert convs[0][-1] == {"role": "assistant", "content": rows[0]["final_answer"]}
    assert convs[0][3]["role"] == "tool" and "@" in convs[0][3]["content"]  # a real directory lookup
    cfg = PolicyConfig(device="cpu", cache_dir=str(tmp_path), tiny_model=TinyModelRecipe(**SMALL))
    policy = _policy(ensure_base(cfg, rows, log=lambda _: None, conversations=convs), max_seq_len=512)
    first = warm_start(policy, rows, steps=1, batch_size=8, lr=1e-9, conversations=convs)
    last = warm_start(policy, rows, steps=40, batch_size=8, lr=5e-3, conversations=convs)
    assert last["warm_start_loss"] < 0.6 * first["warm_start_loss"]


SANDBOX = DATA.with_name("sandbox_train.jsonl")


@pytest.mark.skipif(not SANDBOX.exists(), reason="examples/data not generated")
def test_sandbox_demonstrations_come_from_a_live_interpreter():
    rows = [json.loads(l) for l in SANDBOX.read_text().splitlines()[:2]]
    convs = simulate_rows(rows)
    tool_msgs = [m["content"] for m in convs[0] if m["role"] == "tool"]
    assert len(tool_msgs) == len(rows[0]["ground_truth"])
    code = rows[0]["ground_truth"][0]["arguments"]["code"]
    setup = rows[0]["seed"]["setup"]
    ns: dict = {}
    exec(setup, ns)  # what the interpreter printed must be what this code prints
    expected = str(eval(code[len("print("):-1], ns)) + "\n" if code.startswith("print(") else None
    if expected is not None:
        assert tool_msgs[0] == expected


def test_warm_start_rejects_bad_rows(policy):
    with pytest.raises(ValueError, match="ground_truth"):
        warm_start(policy, [{"responses_create_params": {"input": []}}], steps=1)
    with pytest.raises(ValueError, match="label_smoothing"):
        warm_start(policy, [], steps=1, label_smoothing=1.0)
    with pytest.raises(ValueError, match="task_source 'mystery'"):
        warm_start(policy, [{"task_source": "mystery", "responses_create_params": {"input": []},
                             "ground_truth": [{"name": "lookup", "arguments": {}}]}], steps=1)

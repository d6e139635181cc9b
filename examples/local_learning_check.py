"""Local learning sanity check: warm start + GRPO on the workplace world, no HTTP.

Not a test: a script to tune the warm start and GRPO settings and to see that
reward goes up. Rollouts run against ``OfficeWorld`` directly, with all
episodes of a step decoded turn by turn in one batch; otherwise it is the same
data path as the real job (chat template, parse_completion, RolloutSample,
GRPOTrainer.train_step).

    python examples/local_learning_check.py --steps 30 --eval-gens 1

A tuning script, not part of the product (it imports the workplace world directly, which the
product never does: RL reaches Gym through its client surface, docs/design.md §3).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from nemo_rl.algorithms.grpo import GRPOTrainer
from nemo_rl.algorithms.grpo_config import GenerationConfig, GRPOConfig, LossConfig, PolicyConfig
from nemo_rl.algorithms.warm_start import simulate_rows, warm_start
from nemo_rl.experience.sample import ModelCall, RolloutSample
from nemo_rl.models.chat import parse_tool_calls, render_prompt
from nemo_rl.models.policy import HFPolicy, load_policy
from nemo_rl.models.tiny_model import ensure_base

REPO = Path(__file__).resolve().parents[1]


def load_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@torch.no_grad()
def run_workplace_rollouts(policy: HFPolicy, rows: list[dict], gens: int, temperature: float,
                           max_new_tokens: int, max_turns: int, weight_version: int, step: int,
                           generator: torch.Generator | None = None) -> list[RolloutSample]:
    """One group of ``gens`` episodes per row, played against fresh OfficeWorlds."""
    from gym_patches.resources_servers.workplace import ToolError, seed_from_row, verify

    eps = []
    for ri, row in enumerate(rows):
        for g in range(gens):
            eps.append({"row": row, "group": f"s{step}_p{ri}", "g": g, "world": seed_from_row(row),
                        "messages": [dict(m) for m in row["responses_create_params"]["input"]],
                        "calls": [], "done": False})
    for _turn in range(max_turns):
        live = [e for e in eps if not e["done"]]
        if not live:
            break
        prompts = [render_prompt(policy.tokenizer, e["messages"], e["row"]["responses_create_params"].get("tools"))
                   for e in live]
        outs = policy.sample_batch(prompts, [max_new_tokens] * len(live), [temperature] * len(live),
                                   generator=generator)
        for e, p, o in zip(live, prompts, outs):
            e["calls"].append(ModelCall(prompt_token_ids=p, generation_token_ids=o.token_ids,
                                        generation_log_probs=o.logprobs, weight_version=weight_version))
            content, tool_calls = parse_tool_calls(policy.decode_completion(o.token_ids))
            e["messages"].append({"role": "assistant", "content": content, "tool_calls": tool_calls or None})
            if o.finish_reason != "stop" or not tool_calls:
                e["done"] = True
                continue
            for c in tool_calls:
                try:
                    out = e["world"].call_tool(c["function"]["name"], json.loads(c["function"]["arguments"]))
                except ToolError as err:
                    out = f"Error: {err}"
                e["messages"].append({"role": "tool", "tool_call_id": c["id"], "content": out})
    return [RolloutSample(rollout_id=f"{e['group']}_g{e['g']}", group_id=e["group"], generation_index=e["g"],
                          reward=verify(e["world"], e["row"]), calls=e["calls"]) for e in eps]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(REPO / "examples/data/workplace_train.jsonl"))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warm-steps", type=int, default=800)
    ap.add_argument("--warm-lr", type=float, default=5e-3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--gens", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--max-turns", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--cache-dir", default=None, help="where the embedded model's tokenizer/init are cached")
    ap.add_argument("--eval-gens", type=int, default=0, help="also measure warm-start success on N x rows")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kl", type=float, default=0.0)
    ap.add_argument("--label-smoothing", type=float, default=0.025)
    ap.add_argument("--save-warm", default="", help="save the warm-started weights here")
    ap.add_argument("--load-warm", default="", help="skip the warm start; load weights saved by --save-warm")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rows = [r for r in load_rows(Path(args.data)) if "people" in (r.get("seed") or {})]
    t0 = time.perf_counter()
    convs = simulate_rows(rows)
    pcfg = PolicyConfig(device="auto", learning_rate=args.lr, cache_dir=args.cache_dir,
                        generation=GenerationConfig(temperature=args.temperature, max_new_tokens=args.max_new_tokens))
    pcfg.tiny_model.hidden_size, pcfg.tiny_model.num_layers = args.hidden, args.layers
    base = ensure_base(pcfg, rows, conversations=convs)
    policy = load_policy(str(base), pcfg.dtype, pcfg.device, pcfg.max_seq_len)
    trainer = GRPOTrainer(pcfg, LossConfig(reference_policy_kl_penalty=args.kl), GRPOConfig(seed=args.seed), policy)
    if args.load_warm:
        policy.load_state(torch.load(args.load_warm, map_location=trainer.device, weights_only=True))
        print(f"vocab {policy.vocab_size}, loaded warm start from {args.load_warm}", flush=True)
    else:
        ws = warm_start(policy, rows, steps=args.warm_steps, lr=args.warm_lr, seed=args.seed,
                        label_smoothing=args.label_smoothing, conversations=convs, progress=True)
        print(f"vocab {policy.vocab_size}, warm start {ws['warm_start_s']:.1f}s loss {ws['warm_start_loss']:.3f}", flush=True)
        if args.save_warm:
            torch.save(trainer.state_dict_for_refit(), args.save_warm)
    trainer.reset_reference()
    gen = torch.Generator(device=trainer.device).manual_seed(args.seed)
    rng = random.Random(args.seed)
    if args.eval_gens:
        t = time.perf_counter()
        s = run_workplace_rollouts(policy, rows, args.eval_gens, args.temperature,
                                   args.max_new_tokens, args.max_turns, 0, -1, gen)
        print(f"warm-start success {sum(x.reward for x in s) / len(s):.3f} over {len(s)} episodes "
              f"({time.perf_counter() - t:.1f}s)", flush=True)
    rewards = []
    for step in range(args.steps):
        t = time.perf_counter()
        batch = rng.sample(rows, args.prompts)
        samples = run_workplace_rollouts(policy, batch, args.gens, args.temperature,
                                         args.max_new_tokens, args.max_turns, trainer.weight_version, step, gen)
        gen_s = time.perf_counter() - t
        m = trainer.train_step(samples)
        rewards.append(m["reward_mean"])
        print(f"step {step + 1:3d} reward {m['reward_mean']:.3f} loss {m['loss']:+.4f} "
              f"calls/rollout {m['calls_per_rollout']:.2f} gen_tok {m['mean_gen_tokens']:.1f} "
              f"clip {m['pg_clip_frac']:.3f} lp_err {m['gen_logprob_abs_err']:.2e} "
              f"gen {gen_s:.1f}s train {m['train_s']:.1f}s", flush=True)
    k = max(1, len(rewards) // 5)
    if rewards:
        first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
        print(f"first fifth {first:.3f} last fifth {last:.3f} delta {last - first:+.3f} "
              f"total {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    main()

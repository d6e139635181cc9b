"""What deterministic sampling must survive, measured on a real model on this CPU (``grpo.deterministic``).

    python examples/bench/sampling_invariance.py --model <model dir> [--calls 32] [--tokens 96]

Two questions, each answered with the counter-based draws deterministic mode samples with
(``nemo_rl.models.generation.call_seeds``), on prompts made of the model's own vocabulary:

1. Batching: is a row's float result in a batch the one it gets decoded alone? For batch sizes 2, 4 and 8,
   each call is decoded in a batch of others (same seeds) and alone; printed: the largest |logprob
   difference| and the share of calls whose tokens differ. A non-zero difference is why deterministic mode
   decodes one call at a time.
2. A generation cut (``target_level: prefix``): a call continued after k of its tokens re-prefills them in
   one forward instead of decoding them one by one. For cut points k, printed: the share of continued
   calls whose tokens after the cut differ from the uninterrupted call's, the share of tokens after the
   cut that differ, and the largest |logprob difference|.

A measurement of float behaviour, not of time: it does not need a quiet machine.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nemo_rl.models.generation.call_seeds import CallDraws, call_seed  # noqa: E402
from nemo_rl.models.policy import HFPolicy, load_policy  # noqa: E402
from nemo_rl.parity.compare import Tolerance  # noqa: E402

TOL = Tolerance()  # the parity harness's default: rtol 1e-5, atol 1e-6


def _decode(policy: HFPolicy, prompts: list[list[int]], seeds: list[int], tokens: int,
            offsets: list[int] | None = None):
    offsets = offsets or [0] * len(prompts)
    return policy.sample_batch(prompts, [tokens] * len(prompts), [1.0] * len(prompts),
                               ignore_eos=[True] * len(prompts),
                               draws=[CallDraws(s, o) for s, o in zip(seeds, offsets)])


def batching(policy: HFPolicy, prompts: list[list[int]], seeds: list[int], tokens: int) -> list[dict]:
    alone = [_decode(policy, [p], [s], tokens)[0] for p, s in zip(prompts, seeds)]
    rows = []
    for size in (2, 4, 8):
        worst, differ, beyond = 0.0, 0, 0
        for i in range(0, len(prompts) - size + 1, size):
            outs = _decode(policy, prompts[i:i + size], seeds[i:i + size], tokens)
            for a, b in zip(alone[i:i + size], outs):
                differ += a.token_ids != b.token_ids
                n = min(len(a.logprobs), len(b.logprobs))
                worst = max(worst, max(abs(x - y) for x, y in zip(a.logprobs[:n], b.logprobs[:n])))
                beyond += sum(not TOL.close(y, x) for x, y in zip(a.logprobs[:n], b.logprobs[:n]))
        calls = (len(prompts) // size) * size
        rows.append({"batch": size, "calls": calls, "max_logprob_diff": worst, "calls_differ": differ,
                     "beyond_tolerance": beyond})
    return rows


def cuts(policy: HFPolicy, prompts: list[list[int]], seeds: list[int], tokens: int, points: list[int]) -> list[dict]:
    whole = [_decode(policy, [p], [s], tokens)[0] for p, s in zip(prompts, seeds)]
    rows = []
    for k in points:
        worst, calls_differ, tokens_differ, compared, beyond = 0.0, 0, 0, 0, 0
        for p, s, w in zip(prompts, seeds, whole):
            tail = _decode(policy, [p + w.token_ids[:k]], [s], tokens - k, [k])[0]
            ref = w.token_ids[k:]
            calls_differ += tail.token_ids != ref
            tokens_differ += sum(x != y for x, y in zip(tail.token_ids, ref))
            compared += len(ref)
            first = next((i for i, (x, y) in enumerate(zip(tail.token_ids, ref)) if x != y), len(ref))
            if first:  # logprobs compared up to the first changed token (after it the calls differ anyway)
                pairs = list(zip(w.logprobs[k:k + first], tail.logprobs[:first]))
                worst = max(worst, max(abs(x - y) for x, y in pairs))
                beyond += sum(not TOL.close(y, x) for x, y in pairs)
        rows.append({"cut_at": k, "calls": len(prompts), "calls_differ": calls_differ,
                     "tokens_after_cut": compared, "tokens_differ": tokens_differ, "max_logprob_diff": worst,
                     "beyond_tolerance": beyond})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a Hugging Face model directory (e.g. the embedded model's cache)")
    p.add_argument("--calls", type=int, default=32)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the generation worker uses 1)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    policy = load_policy(args.model, "float32", "cpu", 1024)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, policy.vocab_size) for _ in range(rng.randint(8, 64))] for _ in range(args.calls)]
    seeds = [call_seed(42, f"s1p{i}_g0", 0) for i in range(args.calls)]
    print("| batch size | calls | calls whose tokens differ from alone | max |logprob d| | logprobs beyond "
          "rtol 1e-5 / atol 1e-6 |")
    print("|---|---|---|---|---|")
    for r in batching(policy, prompts, seeds, args.tokens):
        print(f"| {r['batch']} | {r['calls']} | {r['calls_differ']} | {r['max_logprob_diff']:.2e} | "
              f"{r['beyond_tolerance']} of {r['calls'] * args.tokens} |")
    print()
    print("| cut after k tokens | calls | calls that change after the cut | tokens after the cut | tokens that "
          "differ | max |logprob d| | logprobs beyond rtol 1e-5 / atol 1e-6 |")
    print("|---|---|---|---|---|---|---|")
    for r in cuts(policy, prompts, seeds, args.tokens, [1, 8, 24, 48, args.tokens - 8]):
        print(f"| {r['cut_at']} | {r['calls']} | {r['calls_differ']} | {r['tokens_after_cut']} | {r['tokens_differ']} "
              f"| {r['max_logprob_diff']:.2e} | {r['beyond_tolerance']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

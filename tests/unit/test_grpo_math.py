"""GRPO math against hand-computed values."""

import math

import pytest
import torch

from nemo_rl.algorithms.grpo import compute_group_advantages
from nemo_rl.algorithms.loss_functions import clipped_pg_loss


def approx(xs, ys, tol=1e-5):
    return len(xs) == len(ys) and all(abs(a - b) < tol for a, b in zip(xs, ys))


# ----- advantages ---------------------------------------------------------
def test_advantages_normalized_by_sample_std():
    # mean 0.25; sample std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5
    adv = compute_group_advantages([[1, 0, 0, 0]], normalize=True)
    assert approx(adv[0], [1.5, -0.5, -0.5, -0.5])


def test_advantages_unnormalized_are_mean_centred():
    adv = compute_group_advantages([[1, 0, 0, 0], [2.0, 4.0]], normalize=False)
    assert approx(adv[0], [0.75, -0.25, -0.25, -0.25])
    assert approx(adv[1], [-1.0, 1.0])


def test_advantages_each_group_uses_its_own_baseline():
    # [2, 4]: mean 3, sample std sqrt(2) -> -+1/sqrt(2); [1, 1, 1]: no signal
    adv = compute_group_advantages([[2.0, 4.0], [1, 1, 1], [5.0]], normalize=True)
    assert approx(adv[0], [-1 / math.sqrt(2), 1 / math.sqrt(2)])
    assert adv[1] == [0.0, 0.0, 0.0]
    assert adv[2] == [0.0]


def test_advantages_reject_bad_groups():
    with pytest.raises(ValueError, match="group 1 is empty"):
        compute_group_advantages([[1.0], []])
    with pytest.raises(ValueError, match="non-finite"):
        compute_group_advantages([[1.0, float("nan")]])


# ----- loss ---------------------------------------------------------------
def _leaf(values):
    return torch.tensor(values, dtype=torch.float32, requires_grad=True)


def test_on_policy_loss_is_minus_mean_advantage_and_grad_sign():
    lp = _leaf([[-1.0, -2.0, -3.0], [-0.5, -0.5, -9.0]])
    old = lp.detach().clone()
    adv = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    loss, m = clipped_pg_loss(lp, old, adv, mask, 0.2, 0.2)
    # ratio 1 everywhere: loss = -(2 + 2 + 2 - 1 - 1) / 5
    assert loss.item() == pytest.approx(-4 / 5)
    loss.backward()
    # d loss / d lp = -A * ratio / N on unmasked tokens; descent raises lp where A > 0
    assert torch.allclose(lp.grad, torch.tensor([[-0.4, -0.4, -0.4], [0.2, 0.2, 0.0]]))
    assert m["num_tokens"] == 5 and m["pg_clip_frac"] == 0.0 and m["ratio_mean"] == pytest.approx(1.0)


@pytest.mark.parametrize(
    "adv, ratio, expected_loss, grad_flows",
    [
        (1.0, 1.5, -1.2, False),  # A>0 above 1+clip_max: clipped, no push further
        (1.0, 0.5, -0.5, True),  # A>0 below 1-clip_min: unclipped, keep pushing up
        (-1.0, 0.5, 0.8, False),  # A<0 below 1-clip_min: clipped, no push further
        (-1.0, 1.5, 1.5, True),  # A<0 above 1+clip_max: unclipped, keep pushing down
        (2.0, 1.1, -2.2, True),  # inside the trust region
    ],
)
def test_clipping_both_sides(adv, ratio, expected_loss, grad_flows):
    old = torch.tensor([[-1.0]])
    lp = _leaf([[-1.0 + math.log(ratio)]])
    loss, m = clipped_pg_loss(lp, old, torch.tensor([adv]), torch.ones(1, 1), 0.2, 0.2)
    assert loss.item() == pytest.approx(expected_loss, rel=1e-5)
    loss.backward()
    assert (lp.grad.abs().item() > 0) == grad_flows
    assert m["pg_clip_frac"] == (0.0 if grad_flows else 1.0)
    if grad_flows:
        assert lp.grad.item() == pytest.approx(-adv * ratio, rel=1e-5)


def test_asymmetric_clip_bounds():
    old = torch.zeros(1, 2)
    lp = _leaf([[math.log(1.25), math.log(0.5)]])
    adv = torch.tensor([[1.0, -1.0]])
    # clip_max 0.3 leaves 1.25 unclipped; clip_min 0.4 clips 0.5 up to 0.6 for A<0
    loss, _ = clipped_pg_loss(lp, old, adv, torch.ones(1, 2), clip_min=0.4, clip_max=0.3)
    assert loss.item() == pytest.approx((-1.25 + 0.6) / 2, rel=1e-5)


def test_masked_tokens_do_not_matter_even_if_garbage():
    old = torch.tensor([[-1.0, -1.0, 0.0]])
    adv = torch.tensor([1.0])
    mask = torch.tensor([[1, 1, 0]])
    lp_a = _leaf([[-0.9, -1.2, 0.0]])
    lp_b = _leaf([[-0.9, -1.2, 80.0]])
    la, _ = clipped_pg_loss(lp_a, old, adv, mask, 0.2, 0.2)
    lb, _ = clipped_pg_loss(lp_b, torch.tensor([[-1.0, -1.0, float("-inf")]]), adv, mask, 0.2, 0.2)
    assert torch.isfinite(lb) and la.item() == pytest.approx(lb.item())
    lb.backward()
    assert lp_b.grad[0, 2].item() == 0.0 and torch.isfinite(lp_b.grad).all()


def test_global_normalizer_makes_microbatches_add_up():
    torch.manual_seed(0)
    lp = torch.randn(4, 5)
    old = lp + 0.1 * torch.randn(4, 5)
    adv = torch.tensor([1.0, -0.5, 2.0, 0.0])
    mask = (torch.rand(4, 5) > 0.3).float()
    full, _ = clipped_pg_loss(lp, old, adv, mask, 0.2, 0.28)
    n = mask.sum().item()
    parts = [clipped_pg_loss(lp[s], old[s], adv[s], mask[s], 0.2, 0.28, normalizer=n)[0] for s in (slice(0, 1), slice(1, 4))]
    assert full.item() == pytest.approx(sum(p.item() for p in parts), rel=1e-6)


def test_kl_penalty_k3():
    lp = _leaf([[-1.0, -2.0]])
    ref = torch.tensor([[-0.5, -2.0]])
    adv = torch.tensor([0.0])
    loss, m = clipped_pg_loss(lp, lp.detach(), adv, torch.ones(1, 2), 0.2, 0.2, ref_logprobs=ref, kl_coef=0.1)
    k3 = math.exp(0.5) - 0.5 - 1  # d = ref - lp = 0.5 on token 0, 0 on token 1
    assert m["kl_ref"] == pytest.approx(k3 / 2, rel=1e-5)
    assert loss.item() == pytest.approx(0.1 * k3 / 2, rel=1e-5)
    loss.backward()
    # d/dlp of (e^(ref-lp) - (ref-lp) - 1) = 1 - e^(ref-lp): pulls lp up toward ref
    assert lp.grad[0, 0].item() == pytest.approx(0.1 * (1 - math.exp(0.5)) / 2, rel=1e-5)
    assert lp.grad[0, 1].item() == pytest.approx(0.0, abs=1e-7)


def test_loss_input_errors():
    with pytest.raises(ValueError, match="same shape"):
        clipped_pg_loss(torch.zeros(2, 3), torch.zeros(2, 2), torch.zeros(2), torch.ones(2, 3), 0.2, 0.2)
    with pytest.raises(ValueError, match="unmasked"):
        clipped_pg_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1), torch.zeros(1, 2), 0.2, 0.2)

"""The exponential race with its noise made in the kernel: against its twin given the noise, and
as a sampler (distribution, seeds) under the interpreter and on CUDA."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.triton.exponential_race import BLOCK, exponential_race

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cols", [5, BLOCK + 3])
def test_race_given_noise_matches_twin(device: str, cols: int) -> None:
    g = torch.Generator().manual_seed(cols)
    probs = torch.rand(6, cols, generator=g).softmax(-1)
    probs[1, : cols // 2] = 0.0  # filtered tokens: never drawn
    noise = torch.empty(6, cols).exponential_(generator=g).clamp_min_(torch.finfo(torch.float32).tiny)
    got = exponential_race(probs.to(device), noise=noise.to(device)).cpu()
    assert torch.equal(got, reference.exponential_race(probs, noise))
    assert got[1] >= cols // 2


@pytest.mark.parametrize("device", DEVICES)
def test_race_samples_the_distribution(device: str) -> None:
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04, 0.0])
    n = 600 if device == "cpu" else 20_000  # the interpreter runs a program at a time
    ids = exponential_race(probs.expand(n, -1).contiguous().to(device), torch.arange(n, device=device) * 7919)
    counts = torch.bincount(ids.cpu(), minlength=7).double()
    expected = probs.double() * n
    assert counts[6] == 0
    chi2 = ((counts[:6] - expected[:6]) ** 2 / expected[:6]).sum()
    assert chi2 < 30  # 5 degrees of freedom: P(chi2 > 30) ~ 1.5e-5


@pytest.mark.parametrize("device", DEVICES)
def test_a_rows_draw_depends_on_its_seed_alone(device: str) -> None:
    probs = torch.full((4, 300), 1 / 300).to(device)
    seeds = torch.tensor([5, 6, 5, 7], device=device)
    ids = exponential_race(probs, seeds)
    assert ids[0] == ids[2]  # same seed, same draw, wherever the row sits
    alone = exponential_race(probs[:1], seeds[2:3])
    assert alone[0] == ids[0]
    wide = torch.zeros(1, BLOCK * 2, device=device)
    wide[0, :300] = 1 / 300  # more chunks: the noise is keyed by column, not by chunk
    assert exponential_race(wide, seeds[:1], cols=BLOCK * 2)[0] == ids[0]

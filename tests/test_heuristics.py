"""Unit tests of the host-side launch heuristics (src/heuristics.h), exposed
through the CPU extension so they run everywhere."""

from __future__ import annotations

import math

import numpy as np
import pytest

from jax_flash2 import _ext

choose = _ext.cpu_ext.choose_num_splits


def _efficiency(blocks, splits, slots):
  waves = blocks * splits / slots
  return waves / math.ceil(waves)


def test_full_grid_is_not_split():
  # B=4, H=16, T=4096 with 128-row blocks: 2048 blocks over 264 slots.
  assert choose(4 * 16 * 32, 64, 264, 128) == 1


def test_decode_is_split():
  # B=1, 4 KV heads (query group packed), one m-block, 32k keys in 64-key blocks.
  splits = choose(4, 512, 264, 128)
  assert 1 < splits <= 128
  assert 4 * splits >= 0.8 * 264 * 0.85  # fills most of the machine


def test_degenerate_inputs():
  assert choose(0, 10, 264, 128) == 1
  assert choose(8, 1, 264, 128) == 1  # one key block: nothing to split
  assert choose(8, 100, 264, 1) == 1  # splitting disabled


@pytest.mark.parametrize("min_efficiency", [0.85, 0.95])
@pytest.mark.parametrize("seed", range(5))
def test_choice_is_the_smallest_within_min_efficiency_of_best(seed, min_efficiency):
  rng = np.random.default_rng(seed)
  for _ in range(200):
    blocks = int(rng.integers(1, 300))
    n_blocks = int(rng.integers(1, 2000))
    slots = int(rng.integers(1, 600))
    max_splits = int(rng.integers(1, 200))
    s = choose(blocks, n_blocks, slots, max_splits, min_efficiency)
    assert 1 <= s <= max(1, min(max_splits, n_blocks, slots))
    if blocks * 5 >= slots * 4 or n_blocks <= 1 or max_splits <= 1:
      assert s == 1
      continue
    cap = min(max_splits, slots, n_blocks)
    eligible = [c for c in range(1, cap + 1)
                if c == 1 or -(-n_blocks // c) != -(-n_blocks // (c - 1))]
    best = max(_efficiency(blocks, c, slots) for c in eligible)
    assert s in eligible
    assert _efficiency(blocks, s, slots) >= min_efficiency * best - 1e-12
    assert all(_efficiency(blocks, c, slots) < min_efficiency * best for c in eligible if c < s)

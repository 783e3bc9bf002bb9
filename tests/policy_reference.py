"""NumPy references of the policy-gradient formulas that GRPO's tests (tests/test_grpo_math.py)
and the Tinker losses' (tests/test_session_training.py) share, written from their definitions:

  surrogate   -min(r A, clip(r, low, high) A)       PPO's clipped surrogate of the ratio r
                                                    (GRPO: low = 1 - eps_low, high = 1 + eps_high;
                                                    Tinker's ppo: clip_low/high_threshold)
  clipped     low side r < low and A < 0, high side r > high and A > 0: there the clipped
              branch is the smaller one, so the surrogate's derivative in r is 0; elsewhere -A
"""

import numpy as np


def surrogate(ratio, A, low, high):
    return -np.minimum(ratio * A, np.clip(ratio, low, high) * A)


def clipped_sides(ratio, A, low, high):
    return (ratio < low) & (A < 0), (ratio > high) & (A > 0)


def d_surrogate_d_ratio(ratio, A, low, high):
    low_side, high_side = clipped_sides(ratio, A, low, high)
    return -A * ~(low_side | high_side)

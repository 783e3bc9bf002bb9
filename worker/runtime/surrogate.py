"""PPO's clipped surrogate, the piece of policy-gradient math that GRPO (worker/kinds/grpo.py,
bounds 1 - epsilon_low and 1 + epsilon_high) and the Tinker losses ppo (worker/sessions/losses.py,
absolute bounds clip_low_threshold and clip_high_threshold) share:

    surrogate_t = -min(ratio_t * A_t, clip(ratio_t, low, high) * A_t)

The clipped branch is the minimum, and so the token gets no gradient, exactly where
    low side:  ratio_t < low  and A_t < 0
    high side: ratio_t > high and A_t > 0
(clipped_sides; GRPO's clip_ratio statistics count them).
"""

import mlx.core as mx


def clipped_surrogate(ratio: mx.array, advantages: mx.array, low, high) -> mx.array:
    """-min(ratio * A, clip(ratio, low, high) * A), elementwise (low, high: numbers or arrays)."""
    return -mx.minimum(ratio * advantages, mx.clip(ratio, low, high) * advantages)


def clipped_sides(ratio: mx.array, advantages: mx.array, low, high) -> tuple[mx.array, mx.array]:
    """Where the clipped branch holds the gradient at 0: (low side, high side), boolean."""
    return (ratio < low) & (advantages < 0), (ratio > high) & (advantages > 0)

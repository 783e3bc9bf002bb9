"""Normal draws for random weights (worker/runtime/make_model.py init_weights): numpy's
generator, as make_model draws them, against mx.random.normal, in one process.

    python bench/random_normal.py [--values 16777216] [--rounds 9]

Each round draws --values float32 normals both ways (the order alternating between rounds),
scaled and evaluated as MLX arrays. Prints each round's seconds and the ratio mx.random /
numpy: its median, min and max.
"""

import argparse
import statistics
import time

import mlx.core as mx
import numpy as np


def numpy_draw(n: int, i: int) -> None:
    values = np.random.default_rng([0, i]).standard_normal(n, dtype=np.float32)
    values *= np.float32(0.02)
    mx.eval(mx.array(values))


def mlx_draw(n: int, i: int) -> None:
    mx.eval(mx.random.normal((n,), dtype=mx.float32, key=mx.random.key(i)) * 0.02)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--values", type=int, default=16 * 2**20)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    ratios = []
    for i in range(args.rounds):
        draws = [("numpy", numpy_draw), ("mx.random", mlx_draw)]
        seconds = {}
        for name, draw in draws if i % 2 else draws[::-1]:
            t0 = time.perf_counter()
            draw(args.values, i)
            seconds[name] = time.perf_counter() - t0
        ratios.append(seconds["mx.random"] / seconds["numpy"])
        print(f"round {i}: numpy {seconds['numpy']:.3f} s, mx.random {seconds['mx.random']:.3f} s")
    print(f"mx.random.normal / numpy: median {statistics.median(ratios):.2f}x "
          f"(min {min(ratios):.2f}, max {max(ratios):.2f}) over {args.rounds} rounds of {args.values} values")


if __name__ == "__main__":
    main()

"""MLX's quantized matmul on the GPU against the same product on the CPU, for the shapes a job's
fused groups give it: each projection alone and q/k/v (or gate/up) as one matmul, forward
(transpose=True) and the input's gradient (transpose=False), float32 and bfloat16.

    python bench/quantized_paths.py [--rows 1 4 48] [--bits 4] [--group-size 64]

This prints, per case, the largest difference from the CPU's product relative to the product's
largest value: which shapes and which direction the GPU gets wrong, if any. On an H100 (MLX
0.32.4) the tiny test model's q/k/v and gate/up products of more than one row, x W^T, were wrong
(1e37 or NaN): their input is one group wide (hidden 64), the one case MLX's CUDA backend hands
to its sm90 kernel; every other case was right (docs/performance.md, issue 41's fifth sitting).
"""

import argparse
import itertools

import mlx.core as mx

# (input width, [output widths]): the tiny test model's q/k/v and gate/up (worker/runtime/make_model.py
# size tiny), and qwen3-0.6b's.
SHAPES = {
    "tiny q/k/v": (64, [64, 32, 32]),
    "tiny gate/up": (64, [128, 128]),
    "tiny down": (128, [64]),
    "qwen3-0.6b q/k/v": (1024, [2048, 1024, 1024]),
    "qwen3-0.6b gate/up": (1024, [3072, 3072]),
    "qwen3-0.6b down": (3072, [1024]),
}


def product(x, q, transpose, args, stream):
    return mx.quantized_matmul(x, *q, transpose=transpose, group_size=args.group_size, bits=args.bits, stream=stream)


def worst(got: mx.array, want: mx.array) -> float:
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    return (mx.abs(got - want).max() / mx.maximum(mx.abs(want).max(), 1e-30)).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 48])
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=64)
    args = ap.parse_args()
    device = mx.default_device()  # the products under test; the CPU's are the reference
    print(f"device {device}, mlx {mx.__version__}, {args.bits} bits, group {args.group_size}; largest |"
          f"{'GPU' if device == mx.gpu else 'CPU'} - CPU| / largest |CPU|")
    key = (mx.random.key(i) for i in itertools.count())  # a key a draw, as many as the shapes take
    for name, (k, widths) in SHAPES.items():
        weights = [mx.random.normal((n, k), key=next(key)) / k ** 0.5 for n in widths]
        for dtype in (mx.float32, mx.bfloat16):
            alone = [mx.quantize(w.astype(dtype), args.group_size, args.bits) for w in weights]
            fused = [mx.concatenate(parts) for parts in zip(*alone)]  # as worker/runtime/projection_groups.py
            for rows in args.rows:
                x = mx.random.normal((rows, k), key=next(key)).astype(dtype)
                g = mx.random.normal((rows, sum(widths)), key=next(key)).astype(dtype)
                line = []
                fused_x = product(x, fused, True, args, device)
                line.append(f"fused x W^T {worst(fused_x, product(x, fused, True, args, mx.cpu)):.1e}")
                line.append(f"fused g W {worst(product(g, fused, False, args, device), product(g, fused, False, args, mx.cpu)):.1e}")
                each = [product(x, q, True, args, device) for q in alone]
                want = [product(x, q, True, args, mx.cpu) for q in alone]
                line.append(f"alone x W^T {max(worst(a, b) for a, b in zip(each, want)):.1e}")
                line.append(f"fused vs alone {worst(fused_x, mx.concatenate(each, axis=-1)):.1e}")
                print(f"  {name:20} {str(dtype).split('.')[-1]:8} rows {rows:3} | " + " | ".join(line))


if __name__ == "__main__":
    main()

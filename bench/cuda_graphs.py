"""What MLX's CUDA graphs held: a tally of the DOT files MLX writes for each graph it commits
when MLX_SAVE_CUDA_GRAPHS_DOT_FILE is set (MLX's `mlx/backend/cuda/device.cpp`), so two runs (a
LoRA step's, a full step's) can be compared by their graphs' count, size and kernels; and of
cuBLASLt's trace log where the folder has one (CUBLASLT_LOG_LEVEL=2, CUBLASLT_LOG_FILE): its
cublasLtMatmul calls grouped by what they multiply and the algorithm cuBLASLt ran for it.

    MLX_SAVE_CUDA_GRAPHS_DOT_FILE=/tmp/graphs/lora/g CUBLASLT_LOG_LEVEL=2 \
    CUBLASLT_LOG_FILE=/tmp/graphs/lora/cublaslt.log python3 bench/lora_step.py MODEL \
        --variants step_lora --rounds 1 --steps 1 --warmup 2
    python3 bench/cuda_graphs.py /tmp/graphs/lora [/tmp/graphs/full ...]

Why: MLX keeps an instantiated graph and updates it in place for the next step, except a graph
holding a kernel launched in a cluster taller than one, which it instantiates anew at every commit
(`subgraph_to_key`). cuBLASLt's Hopper kernels name their cluster shape (e.g. `..._1x2_...` in
nvjet names, `cluster1x2x1` in sm90 xmma names): the tally prints the kernels whose names carry a
shape whose second or third figure is above 1, and how many graphs hold one.
Reads files only: runs anywhere (the DOT files come from a CUDA machine).
"""

import argparse
import collections
import re
from pathlib import Path

# a node's attributes up to its label: a kernel node is an octagon whose label is its index, then
# the kernel's name (MLX 0.32.4), or in a verbose dump a KERNEL line, then the name
NODE = re.compile(r'\[([^\]]*?)label="((?:[^"\\]|\\.)*)"')
# a cluster shape inside a kernel's name: cluster1x2x1 (sm90 xmma) or _1x2_ after the tile sizes (nvjet);
# in cuBLASLt's log, CLUSTER_SHAPE_1x2x1
CLUSTER = re.compile(r"(?:cluster|CLUSTER_SHAPE_)(\d+)x(\d+)x(\d+)|_(\d+)x(\d+)_(?=[a-z])")
# what varies between two calls of one matmul in cuBLASLt's log: the time, the process, the pointers
VOLATILE = re.compile(r"^\[[^]]*\]\[[^]]*\]\[[^]]*\]|\b0[xX][0-9a-fA-F]+|\[\d+\]")


def kernels(dot: str) -> list[str]:
    """The kernel names of one DOT file's kernel nodes."""
    names = []
    for attributes, label in NODE.findall(dot):
        lines = [line.strip() for line in re.split(r"\\[nl]|\n", label)]
        marked = [lines[i + 1] for i, line in enumerate(lines[:-1]) if line.upper() == "KERNEL"]
        if marked:
            names += marked
        elif "octagon" in attributes and len(lines) > 1 and lines[0].isdigit() and lines[1]:
            names.append(lines[1])
    return names


def tall_cluster(name: str) -> bool:
    """Whether the name carries a cluster shape whose second or third figure is above 1."""
    for m in CLUSTER.finditer(name):
        figures = [int(g) for g in m.groups() if g is not None]
        if any(f > 1 for f in figures[1:]):
            return True
    return False


def tally(folder: Path, top: int) -> None:
    files = sorted(folder.glob("*.dot"))
    if not files:
        print(f"{folder}: no .dot files")
        return
    per_graph = [kernels(f.read_text(errors="replace")) for f in files]
    names = collections.Counter(n for graph in per_graph for n in graph)
    tall = {n for n in names if tall_cluster(n)}
    holding = sum(1 for graph in per_graph if any(n in tall for n in graph))
    total = sum(len(graph) for graph in per_graph)
    print(f"{folder}: {len(files)} graphs, {total} kernel nodes ({total / len(files):.1f} a graph), "
          f"{len(names)} distinct kernels; {sum(names[n] for n in tall)} nodes of {len(tall)} kernels "
          f"in tall clusters, in {holding} graphs")
    for name, n in names.most_common(top):
        print(f"  {n:6d} {'T' if name in tall else ' '} {name[:150]}")
    if not names:
        print("  no kernel names found; the first lines of", files[0])
        print("\n".join(files[0].read_text(errors="replace").splitlines()[:20]))


def matmuls(folder: Path, top: int) -> None:
    """cuBLASLt's trace logs in folder: the cublasLtMatmul calls, grouped by the call's text less
    what varies between calls (pointers, time, process), most frequent first; T marks a call whose
    algorithm carries a cluster taller than one."""
    logs = sorted(folder.glob("cublaslt*.log"))
    if not logs:
        return
    text = "\n".join(f.read_text(errors="replace") for f in logs)
    calls = collections.Counter(VOLATILE.sub("", line).strip() for line in text.splitlines()
                                if "[cublasLtMatmul]" in line)
    tall = sum(n for call, n in calls.items() if tall_cluster(call))
    print(f"{folder}: {sum(calls.values())} cublasLtMatmul calls in cuBLASLt's log, {len(calls)} distinct, "
          f"{tall} with a tall cluster")
    for call, n in calls.most_common(top):
        print(f"  {n:6d} {'T' if tall_cluster(call) else ' '} {call[:400]}")
    if not calls:
        print("  no cublasLtMatmul lines; the log's first lines:")
        print("\n".join(text.splitlines()[:10]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folders", nargs="+", type=Path)
    p.add_argument("--top", type=int, default=25, help="the most frequent kernels to list")
    args = p.parse_args()
    for folder in args.folders:
        tally(folder, args.top)
        matmuls(folder, args.top)


if __name__ == "__main__":
    main()

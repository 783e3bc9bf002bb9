#!/usr/bin/env bash
# Issue 41's H200 sitting: each target beside its anchor, the figure that matters most first.
# Run from the repository root where MLX has CUDA (the wheels as the workplace's GPU recipe installs
# them, PYTHONPATH set); every line also goes to $OUT/<stage>.txt when OUT is set. A fresh machine
# spends about 5 minutes compiling, a device call lasts at most 10 and the machine goes back 30 s
# after one ends, so a sitting runs its stages detached and its calls only wait (make them one batch):
#
#   bash bench/h200_sitting.sh start grpo decode kernels tests   the stages in turn, in a
#                                        session of their own that outlives the call; logs in /tmp/sitting
#   bash bench/h200_sitting.sh wait 540  until they end or 540 s pass, copying their logs to $OUT as they grow
#
#   bash bench/h200_sitting.sh lora      LoRA step, the job's and one that builds its pairs, against full fine-tuning;
#                                        SFT against `mlx_lm lora`, bfloat16 then 4-bit (3 rounds each); DPO's,
#                                        ORPO's, KTO's and reward models' LoRA steps against their full steps
#   bash bench/h200_sitting.sh graphs    the LoRA and full steps with MLX's CUDA graphs and without (3 rounds
#                                        of one process each, interleaved: on the H100 the full step 3-6% faster
#                                        with them, the LoRA step's rounds either way); then the kernels, graphs and cuBLASLt
#                                        algorithms of the two steps (bench/cuda_graphs.py); each matmul shape
#                                        of the two steps alone, graphs on and off (bench/matmul_shapes.py)
#   bash bench/h200_sitting.sh grpo      GRPO G8 B4 L128 and G16 B4 L256 by default (on CUDA a budget of 75% of the
#                                        GPU's free memory), G8 B4 L128 with max_memory_gb 16, G16 B4 L256 with 5
#                                        (dense decode copies fit the plan there) (3 rounds each), each
#                                        phase's time; TRL's step where torch and trl import
#   bash bench/h200_sitting.sh decode    first the decode of 8 rows, LoRA on 16 blocks, beside itself with MLX's
#                                        quantized matmuls for quantized_kernel's (--undo quantized, 5 interleaved
#                                        rounds); then decode per position, LoRA on 16 blocks and none, 8 and 32 rows, beside
#                                        mlx_lm's decoders (3 interleaved rounds), with LoRA at 8, 16 and 32 rows with
#                                        dense weights beside the quantized (a GRPO job's default on CUDA), each
#                                        kernel's GPU time alone at 8 and 32 rows
#   bash bench/h200_sitting.sh versions  where /tmp/old holds an earlier tree's worker/ and shared/, that tree
#                                        against this one in one process (bench/code_versions.py: decode and
#                                        GRPO G8 B4 L128, 3 interleaved rounds; about 7 minutes)
#   bash bench/h200_sitting.sh decode-graphs  the decode with MLX's CUDA graphs as they are, off, and one
#                                        graph a step (400 nodes, where the H200's default commits every
#                                        100), 3 rounds of one process each
#   bash bench/h200_sitting.sh kernels   first step: cold, warm, another rank / layer count / batch, and a new
#                                        machine fetching the cold run's kernels from a Redis (first_step.py --fleet);
#                                        KINDS=grpo for GRPO's alone (default: sft grpo)
#   bash bench/h200_sitting.sh workers   a job of other numbers compiles nothing (tests/compiled_numbers.py);
#                                        24 jobs in one process, as a worker and as a plain process
#   bash bench/h200_sitting.sh first     first, four decode kernels' first calls in a fresh process, twice on one
#                                        cache (bench/kernel_first_call.py; OTHER_TREE's too, a cache of its own);
#                                        then a fresh process's first GRPO step phase by phase (bench/first_sampling.py):
#                                        on an empty cache, then warm (cuDNN's attention and MLX's CUDA graphs
#                                        left out did not change it); which cached kernels each process read;
#                                        with OTHER_TREE=DIR (another tree's worker/, shared/ and bench/), that
#                                        tree's first step twice on the same cache, after this tree's warm one
#   bash bench/h200_sitting.sh sdpa      GRPO's G8 B4 L128 step and SFT's LoRA step with cuDNN's attention and without
#                                        (MLX_CUDA_USE_CUDNN_SDPA=0; a process each, 2 rounds alternated): what the
#                                        steady step pays or saves where a process builds no cuDNN graphs
#   bash bench/h200_sitting.sh tests     the CUDA runs of the PTX cache's tests (MLX loads the kernels seeded
#                                        there), of the decode kernels' tests and of the groups' tests
#
# The models (qwen3-0.6b's shape: /tmp/q06f-SIZE bfloat16, /tmp/q06-SIZE 4-bit) are made where missing, about
# 30 s each. SIZE=small LORA_LAYERS=4 runs a stage on the tests' small model instead (a dry run of
# the commands; it has 4 blocks).
set -uo pipefail
cd "$(dirname "$0")/.."
stage="${1:?stage: lora, graphs, grpo, decode, versions, decode-graphs, kernels, workers, first, sdpa or tests; or start STAGE... / wait SECONDS}"
case "$stage" in
  start)
    shift
    rm -rf /tmp/sitting && mkdir -p /tmp/sitting  # a second start must not append to the first's logs
    OUT=/tmp/sitting setsid nohup bash -c 'for s in "$@"; do bash bench/h200_sitting.sh "$s"; done; touch /tmp/sitting/done' \
      _ "$@" >/tmp/sitting/all.log 2>&1 </dev/null &
    exit 0 ;;
  wait)
    end=$((SECONDS + ${2:-540}))
    while :; do  # the logs so far, every 5 s until the stages end or the time is up, then once more
      [ -n "${OUT:-}" ] && cp /tmp/sitting/*.txt /tmp/sitting/all.log "$OUT"/ 2>/dev/null
      { [ $SECONDS -lt $end ] && [ ! -f /tmp/sitting/done ]; } || break
      sleep 5
    done
    tail -c 11000 /tmp/sitting/all.log
    exit 0 ;;
esac
size="${SIZE:-qwen3-0.6b}"
py="${PYTHON:-python3}"
lora_layers="${LORA_LAYERS:-16}"  # the decode's LoRA blocks: a GRPO job's default
log="${OUT:-/tmp}/$stage.txt"
failed=0

model() {  # model DIR [BITS]: the directory, made first if missing
  [ -f "$1/config.json" ] || "$py" -m worker.runtime.make_model "$1" --size "$size" ${2:+--quantize "$2"} >/dev/null
  echo "$1"
}

run() {  # run CMD...: the command's output to the terminal and the log, its status counted
  echo "\$ $*" | tee -a "$log"
  local t0=$SECONDS
  "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  echo "# rc $rc, $((SECONDS - t0)) s" | tee -a "$log"
  [ "$rc" = 0 ] || failed=$((failed + 1))
}

bf16=$(model "/tmp/q06f-$size") q4=$(model "/tmp/q06-$size" 4)
case "$stage" in
  lora)
    run "$py" bench/lora_step.py "$bf16" --rounds 3 --steps 8 --warmup 3 --variants step_lora step_lora_built step_full
    run "$py" bench/train_step.py "$bf16" --kinds sft sft-full --mlx-lm --rounds 3 --steps 8 --warmup 3
    run "$py" bench/train_step.py "$q4" --kinds sft --mlx-lm --rounds 3 --steps 8 --warmup 3
    # the other kinds' LoRA step against their full step (issue 41: at most its time), interleaved by round
    run "$py" bench/train_step.py "$bf16" --kinds dpo dpo-full orpo orpo-full kto kto-full reward reward-full \
      --rounds 3 --steps 8 --warmup 3 ;;
  graphs)  # env read once per process (MLX's device.cpp), so a round is a process
    for r in 1 2 3; do  # first the steps with MLX's CUDA graphs and without
      for knobs in MLX_USE_CUDA_GRAPHS=1 MLX_USE_CUDA_GRAPHS=0; do
        echo "# round $r, $knobs" | tee -a "$log"
        run env "$knobs" "$py" bench/lora_step.py "$bf16" --rounds 1 --steps 8 --warmup 3 --variants step_lora step_full
      done
    done
    for v in step_lora step_full; do  # then what the graphs of 3 steps hold, and cuBLASLt's algorithms
      rm -rf "/tmp/graphs/$v" && mkdir -p "/tmp/graphs/$v"
      run env MLX_SAVE_CUDA_GRAPHS_DOT_FILE="/tmp/graphs/$v/g" CUBLASLT_LOG_LEVEL=2 \
        CUBLASLT_LOG_FILE="/tmp/graphs/$v/cublaslt_%i.log" "$py" bench/lora_step.py "$bf16" \
        --rounds 1 --steps 1 --warmup 2 --variants "$v"
    done
    run "$py" bench/cuda_graphs.py /tmp/graphs/step_lora /tmp/graphs/step_full
    for knobs in MLX_USE_CUDA_GRAPHS=1 MLX_USE_CUDA_GRAPHS=0; do  # then the matmuls' shapes, one by one
      run env "$knobs" "$py" bench/matmul_shapes.py "$bf16" --rounds 3 --pad 64
    done ;;
  grpo)
    # the default (on CUDA a budget of 75% of the GPU's free memory), then two budgets: 16 GB, 5 GB (issue 41's G16 B4 L256)
    run "$py" bench/grpo_step.py "$q4" --sweep 8,4,128 16,4,256 --steps 3 --warmup 1 --rounds 3
    run "$py" bench/grpo_step.py "$q4" --sweep 8,4,128 --steps 3 --warmup 1 --rounds 3 --set max_memory_gb=16
    # at 5 GB the plan's KV estimate (1.85 copies, 3.64 GB) leaves room for the dense decode copies (0.91 GB):
    # this line's peak says whether dense decoding fits there (the H100 peaked at 1.84 copies without them)
    run "$py" bench/grpo_step.py "$q4" --sweep 16,4,256 --steps 3 --warmup 1 --rounds 3 --set max_memory_gb=5
    run "$py" bench/step_phases.py "$q4" 8,4,128 --reps 3 --sampling
    if "$py" -c "import torch, trl" 2>/dev/null; then
      run "$py" bench/trl_grpo.py "$bf16" --group-size 8 --batch-size 4 --max-completion-len 128 --steps 5 --warmup 2
    else
      echo "# TRL's anchor not run: torch or trl does not import here" | tee -a "$log"
    fi ;;
  decode)  # first MLX's quantized matmul of 8 rows in place of quantized_kernel (alone on the H100 it was faster)
    run "$py" bench/decode.py "$q4" --rows 8 --tokens 128 --reps 5 --lora-layers "$lora_layers" --queries 2 \
      --ours-only --undo quantized
    run "$py" bench/decode.py "$q4" --rows 8 32 --tokens 128 --reps 3 --lora-layers "$lora_layers" --queries 2
    # ours with dense copies beside the quantized weights: what a GRPO job decodes with on CUDA by default from 8 rows
    # (DENSE_DECODE_ROWS: 0.83x the quantized step there, the seventeenth sitting); 4 rows, whether fewer should too
    run "$py" bench/decode.py "$q4" --rows 4 8 16 32 --tokens 128 --reps 3 --lora-layers "$lora_layers" --queries 2 --ours-only \
      --dense
    run "$py" bench/decode.py "$q4" --rows 8 32 --tokens 128 --reps 3 --queries 2
    run "$py" bench/decode_kernels.py "$q4" --rows 8 32 ;;  # each kernel's GPU time alone: what 32 rows cost
  versions)
    if [ -d /tmp/old/worker ]; then  # an earlier tree (worker/, shared/) against this one in one process
      run "$py" bench/code_versions.py "$q4" /tmp/old . --rows 8 32 --tokens 128 --lora-layers "$lora_layers" \
        --grpo 8,4,128 --rounds 3 --warmup 1
    else
      echo "# no /tmp/old/worker: the A/B of an earlier tree not run" | tee -a "$log"
    fi ;;
  decode-graphs)
    for r in 1 2 3; do  # ours under MLX's CUDA graph settings, a process a round (env read once)
      for knobs in MLX_USE_CUDA_GRAPHS=1 MLX_USE_CUDA_GRAPHS=0 MLX_MAX_OPS_PER_BUFFER=400; do
        echo "# round $r, $knobs" | tee -a "$log"
        run env "$knobs" "$py" bench/decode.py "$q4" --rows 8 32 --tokens 128 --reps 1 --lora-layers "$lora_layers" \
          --ours-only
      done
    done ;;
  kernels)  # with a redis-server (here, or carried to /tmp/redis with its libraries), also a new machine joining a fleet
    fleet=() redis=$(command -v redis-server || echo /tmp/redis/redis-server)
    if [ -x "$redis" ] && LD_LIBRARY_PATH="$(dirname "$redis")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
         "$redis" --port 16399 --save '' --appendonly no --daemonize yes >/dev/null; then
      fleet=(--fleet redis://127.0.0.1:16399/0)
    else
      echo "# the fleet's new machine not run: no redis-server starts here" | tee -a "$log"
    fi
    # the share's cap (default 128 MB) far above one job's kernels, whose size on CUDA it prints
    run env MTQ_KERNEL_SHARE_MB=4096 "$py" bench/first_step.py "$q4" --kinds ${KINDS:-sft grpo} \
      --vary lora_rank=16 lora_layers=2 batch_size=4 lora_alpha=32 weight_decay=0.01 "${fleet[@]}" ;;
  workers)  # a job of other numbers compiles no kernel of its own; a worker's jobs over its life
    run "$py" tests/compiled_numbers.py "$q4" /tmp/kernel-cache-numbers
    run "$py" bench/worker_life.py "$q4" --jobs 24 --steps 3
    # a known shape's later steps slowed 1.65x over 24 jobs on the H100 (seventeenth sitting): 5 steps a
    # job, and the first job once more after mx.clear_cache(), say whether MLX's cache of freed buffers does it
    run "$py" bench/worker_life.py "$q4" --jobs 24 --steps 5 --as-worker ;;
  first)  # where a fresh process's first GRPO step goes: a process that fills a cache, then warm ones on it
    cache=(env TMPDIR=/tmp/first-cache CUDA_CACHE_PATH=/tmp/first-cache/cuda-driver)
    rm -rf /tmp/first-cache /tmp/probe-cache && mkdir -p /tmp/first-cache /tmp/probe-cache
    trees=(.)  # first, each tree's decode kernels alone: what a second process's first call of each pays
    [ -d "${OTHER_TREE:-/nonexistent}/worker" ] && cp bench/kernel_first_call.py "$OTHER_TREE/bench/" && trees+=("$OTHER_TREE")
    for i in "${!trees[@]}"; do  # a cache each: the other tree's seeded modules must not serve this one's
      mkdir -p "/tmp/probe-cache/$i"
      run env TMPDIR="/tmp/probe-cache/$i" "$py" "${trees[$i]}/bench/kernel_first_call.py"
      run env TMPDIR="/tmp/probe-cache/$i" "$py" "${trees[$i]}/bench/kernel_first_call.py"
    done
    run "${cache[@]}" "$py" bench/first_sampling.py "$q4"
    run "${cache[@]}" "$py" bench/first_sampling.py "$q4"  # issue 41's warm first step, phase by phase
    if [ -d "${OTHER_TREE:-/nonexistent}/worker" ]; then  # another tree's worker/ on the same warm cache
      cp bench/first_sampling.py "$OTHER_TREE/bench/"
      run "${cache[@]}" "$py" "$OTHER_TREE/bench/first_sampling.py" "$q4"
      run "${cache[@]}" "$py" "$OTHER_TREE/bench/first_sampling.py" "$q4"  # its second process: what stays
    fi ;;
  sdpa)  # steps with cuDNN's attention and with MLX's own (env read once per process: a process a round, alternated)
    for r in 1 2; do
      for knobs in MLX_CUDA_USE_CUDNN_SDPA=1 MLX_CUDA_USE_CUDNN_SDPA=0; do
        echo "# round $r, $knobs" | tee -a "$log"
        run env "$knobs" "$py" bench/grpo_step.py "$q4" --sweep 8,4,128 --steps 3 --warmup 1 --rounds 1
        run env "$knobs" "$py" bench/train_step.py "$bf16" --kinds sft --rounds 1 --steps 8 --warmup 3
      done
    done ;;
  tests)  # samples and losses unchanged by the speed changes, on CUDA (float32 products: TF32 off)
    # first that MLX loads the kernels seeded into its PTX cache (worker/decode/ptx_cache.py), then
    # what changed since both files passed on the H100 (docs/performance.md): the kernels' tests and qlora's
    run "$py" -m pytest -q -rf tests/test_ptx_cache.py
    run env MLX_ENABLE_TF32=0 "$py" -m pytest -q -rf tests/test_shared_input.py  # the groups, their trainable pairs
    run env MLX_ENABLE_TF32=0 "$py" -m pytest -q -rf tests/test_decode.py -k "kernel or attends" ;;
  *) echo "unknown stage $stage: lora, graphs, grpo, decode, versions, decode-graphs, kernels, workers, first, sdpa or tests" >&2
     exit 2 ;;
esac
echo "# stage $stage: $failed command(s) failed" | tee -a "$log"
[ "$failed" = 0 ]

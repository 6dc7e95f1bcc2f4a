#!/usr/bin/env bash
# Every BENCHMARKS.md row, in parts that each fit a 10-minute device call (2 GPUs).
#
#   bash benchmarks/gpu_suite.sh check    # graphed-vs-eager parity on 2 GPUs + one-GPU graph timing (~4 min)
#   bash benchmarks/gpu_suite.sh 1.3b     # 1.3B: 1 step on 2 GPUs and on 1 GPU, 4 steps on 2 GPUs (~9 min)
#   bash benchmarks/gpu_suite.sh large    # 14B 1 step and 5B 704x1280 4 steps on 2 GPUs (~8 min)
#
# Results go to ${OUT:-benchmarks/results}/*.json, table rows to rows.md beside them; the commit is read
# from $STAGECAST_COMMIT when the tree has no .git.
set -uo pipefail
out="${OUT:-benchmarks/results}"
mkdir -p "$out"
harness=(python -m benchmarks.harness --cuda-graphs --vae-compile --markdown "$out/rows.md")

case "${1:-}" in
  check)
    s=(timeout 150 python -m launcher.cli selftest --device cuda --cuda-graphs)
    "${s[@]}" --dtype bfloat16 --window 3 --sink 1 --chunks 6
    "${s[@]}" --dtype bfloat16 --model wan2.1-1.3b --layers 4 --height 60 --width 104 --window 3 --sink 1 --chunks 6
    "${s[@]}" --dtype float32 --policy clean --window 2 --chunks 5 --partition 1,3
    timeout 120 python -m benchmarks.graphs_check
    ;;
  1.3b)
    timeout 200 "${harness[@]}" --model wan2.1-1.3b --steps 1 --stages 2 --seconds 10 --json "$out/13b_1step_2gpu.json"
    timeout 200 "${harness[@]}" --model wan2.1-1.3b --steps 1 --stages 1 --seconds 10 --json "$out/13b_1step_1gpu.json"
    timeout 200 "${harness[@]}" --model wan2.1-1.3b --steps 4 --stages 2 --seconds 10 --json "$out/13b_4step_2gpu.json"
    ;;
  large)
    timeout 300 "${harness[@]}" --model wan2.1-14b --steps 1 --stages 2 --seconds 10 --peer-chunks 4 --ttff-runs 3 \
      --json "$out/14b_1step_2gpu.json"
    timeout 240 "${harness[@]}" --model wan2.2-ti2v-5b --width 1280 --height 704 --steps 4 --stages 2 --seconds 8 \
      --peer-chunks 4 --ttff-runs 3 --json "$out/5b_4step_2gpu.json"
    ;;
  *)
    sed -n '2,9p' "$0"
    exit 2
    ;;
esac

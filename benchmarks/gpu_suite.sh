#!/usr/bin/env bash
# Every BENCHMARKS.md harness-v2 row, in parts that each fit a 10-minute device call (2 GPUs).
#
#   bash benchmarks/gpu_suite.sh check    # graphed-vs-eager parity on 2 GPUs + one-GPU graph timing (~4 min)
#   bash benchmarks/gpu_suite.sh quick    # every harness path once, short streams (~3 min): run before the rest
#   bash benchmarks/gpu_suite.sh 1.3b     # 1.3B 1 step with the load rows (1, 2, 4, 8 streams)
#   bash benchmarks/gpu_suite.sh tiny     # 1.3B 1 step, one unpaced main stream on the full VAE and again on the tiny
#                                         # decoder in the same system (--decoder full,tiny), ~4 min
#   bash benchmarks/gpu_suite.sh decoders # the decoder table: tiny and Wan VAE, 1/4/8/16 streams (decoder_bench)
#   bash benchmarks/gpu_suite.sh 1.3b-4   # 1.3B 4 steps
#   bash benchmarks/gpu_suite.sh 14b      # 14B 1 step
#   bash benchmarks/gpu_suite.sh warmup-ab # 1.3B 4 steps, short: the first stream after READY with the gateway's
#                                         # warm-up stream and without it (--no-pipeline-warmup), ~5 min
#   bash benchmarks/gpu_suite.sh 5b       # 5B 704x1280 4 steps
#   bash benchmarks/gpu_suite.sh sp-check # SP=2 parity on 2 GPUs (fp32, bf16) + the all-to-all timing (~3 min)
#   bash benchmarks/gpu_suite.sh sp-1.3b pp-1.3b-eager   # 1.3B 1 step: SP=2 against PP=2, both eager (SP has
#   bash benchmarks/gpu_suite.sh sp-14b pp-14b-eager     # 14B 1 step        no CUDA graphs yet); ~5 min per part
#   bash benchmarks/gpu_suite.sh v2v      # video-to-video 1.3B 480x832, 2 steps from strength: throughput + live rows
#   bash benchmarks/gpu_suite.sh slo      # 1.3B paced, SLO-adaptive load rows (steps 1..4): capacity at 16 FPS, the
#                                         # model seeded by the stages' calibration and the gateway's measured VAE
#   bash benchmarks/gpu_suite.sh webrtc   # the browser edge: gRPC vs WebRTC (aiortc peer), text and video-to-video
#                                         # (the device has no network: carry wheels/py312, an ignored folder of
#                                         # aiortc, aiohttp and their dependencies that .whl lacks (aioice, pyee,
#                                         # pylibsrtp, pyopenssl, google-crc32c, dnspython, ifaddr, multidict, yarl,
#                                         # frozenlist, aiosignal, propcache, attrs, aiohappyeyeballs: 6 MB), made
#                                         # here by `pip download --no-deps --only-binary=:all: --python-version 3.12
#                                         # --implementation cp --platform manylinux_2_28_x86_64 ... -d wheels/py312`
#                                         # with the versions `pip show` gives in the dev venv)
#   bash benchmarks/gpu_suite.sh cfg-check # CFG-parallel parity on 2 GPUs (fp32, guidance 5, prompt updates; ~2 min)
#   bash benchmarks/gpu_suite.sh cfg-seq  # 1.3B 1 step, guidance 5: sequential CFG on PP=2
#   bash benchmarks/gpu_suite.sh cfg-par  # 1.3B 1 step, guidance 5: CFG-parallel 2 x PP=1
#   bash benchmarks/gpu_suite.sh fp8-check # --fp8: one stage's blocks (1.3B, 14B) bf16 against float8, speed and
#                                          # difference (benchmarks/fp8_check.py, one GPU, ~3 min)
#   bash benchmarks/gpu_suite.sh fp8      # 1.3B 1 step with --fp8 stages: steady FPS beside the `1.3b` part's row
#                                         # (both fp8 parts install torchao from .whl-fp8/, an ignored folder, when it
#                                         # is missing; made here by: pip download --no-deps --only-binary=:all:
#                                         # --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
#                                         # -d .whl-fp8 torchao==0.17.0, the release built against torch 2.11)
#   bash benchmarks/gpu_suite.sh dit-levers # the DiT levers (fp8, fused, cudnn, each and together) at batch 1, 4,
#                                         # 8, 12: ms per stream-chunk and the error vs bf16 (benchmarks/dit_levers.py,
#                                         # one GPU, ~3 min)
#   bash benchmarks/gpu_suite.sh sdpa-backends # each SDPA kernel (flash, efficient, cuDNN, math) forced alone on the
#                                         # DiT's self- and cross-attention shapes, eager and graphed, two layouts:
#                                         # ms, TFLOP/s, refusals with torch's reason (benchmarks/sdpa_backends.py, ~1 min)
#   bash benchmarks/gpu_suite.sh fused-kernels # the fused lever's kernels alone at batch 1 and 4: us, MB, TB/s against a
#                                         # copy's, compiled dynamic (the lever) and static, RoPE without strided
#                                         # writes (benchmarks/fused_kernels.py, ~1 min)
#   bash benchmarks/gpu_suite.sh host-sync # a stage's batches (1.3B, batch 1 and 4, the DIT_LEVERS, fused@rows unless
#                                         # set): the CUDA syncs each makes, back to back against one at a time
#                                         # (benchmarks/host_sync.py, one GPU, ~2 min)
#   bash benchmarks/gpu_suite.sh attention-check # grouped self-attention (one SDPA per group of equal KV context) against
#                                         # the per-item loop: one stage's blocks (1.3B, 14B) at batch 1, 2, 4 with full
#                                         # 6-frame windows, eager and graphed, ms and max difference
#                                         # (benchmarks/attention_check.py, one GPU, ~4 min)
#   bash benchmarks/gpu_suite.sh vae-graphs # the gateway's VAE eager / compiled / CUDA-graphed / both (and channels-last,
#                                         # for the record), 1 and 4 streams, Wan2.1 480x832 and Wan2.2 704x1280 (one
#                                         # GPU, random weights; benchmarks/vae_graphs_check.py; ~6 min)
#   bash benchmarks/gpu_suite.sh vae-graphs-1.3b # the `1.3b` part (main row, load rows 1, 2, 4, 8) with
#                                         # --vae-cuda-graphs, to set beside it
#   bash benchmarks/gpu_suite.sh pp4 pp4-14b pp2sp2 pp2cfg2   # issue 24's four-rank topologies, 1 step, 480x832:
#                                         # PP=4 (1.3B, 14B), PP=2 x SP=2 (1.3B) and PP=2 x CFG-parallel 2 (1.3B,
#                                         # guidance 5); the JSON names say how many GPUs ran them.  On 4 GPUs one rank
#                                         # per GPU; PP=4 also runs on 2 GPUs (stage i on GPU i % 2: neighbours on
#                                         # different GPUs), to shake the topology out where 4 are not lent
#   bash benchmarks/gpu_suite.sh kv-admission kv-admission-1step   # admission by KV memory (1.3B 480x832, 15 s
#                                         # unpaced streams, 4 and 1 steps): each stage's derived KV budget, a stream
#                                         # without a window (the request that ran a one-GPU stage out of memory)
#                                         # refused naming window or run to the end, then windowed streams (6, 3
#                                         # sinks) opened until one is refused and all run at once; actual KV against
#                                         # the reservation (benchmarks/kv_admission_check.py, ~5 min per part)
#   STAGES=1 bash benchmarks/gpu_suite.sh capacity-1.3b   # the capacity table (harness --capacity, one GPU): 1.3B
#                                         # 1 step, paced 16 FPS streams opened one at a time until admission refuses
#                                         # one, held 20 s; the tiny decoder, then the full VAE in the same system
#                                         # (no main stream, TTFF, interactive stream nor peers; ~4 min)
#   STAGES=1 bash benchmarks/gpu_suite.sh capacity-1.3b-2 # the same, 2 steps (~4 min)
#   STAGES=1 bash benchmarks/gpu_suite.sh capacity-1.3b-4 # the same, SLO-adaptive 1..4 steps (~4 min)
#   STAGES=1 bash benchmarks/gpu_suite.sh capacity-14b    # 14B 1 step, tiny decoder: one unpaced 20 s main stream
#                                         # (goal >= 28 FPS; the stages' ms per forward at batch 1 in system.stages),
#                                         # then capacity (its batch and ms per forward in the row; ~5-6 min)
#   STAGES=1 bash benchmarks/gpu_suite.sh capacity-5b     # 5B 1280x704 1 step, tiny decoder (random taew2_2-shaped
#                                         # weights: 48 latent channels, patch 2); capacity only (~4 min)
#                                         # SLO_VAE_MS=N before any capacity part: admission prices each stream's decode
#                                         # at N ms per chunk (--slo-vae-ms, a what-if; JSON names end _vaeNms)
#                                         # The coordinator's pace grid (paced streams' chunks due together, so they
#                                         # batch) is on by default (JSON names end _grid); PACE_GRID=0: --no-pace-grid
#                                         # LOOKAHEAD=N before any capacity part: the coordinator's --lookahead N, a
#                                         # fixed bound on batches in flight (JSON names end _laN)
#                                         # DIT_LEVERS=fused (or fused@dynamic, fp8,fused,cudnn ...): the stages' --dit-levers
#                                         # (not bit-exact; JSON names end _fused); BATCH=N: the Stream Batch ceiling
#                                         # (--batch, default 4; _bN); BURST=N: after the capacity rows, N paced
#                                         # streams opened at one instant (--burst; _burstN); DECODERS=tiny: that
#                                         # decoder only (default tiny,full; _tiny); GPU_SHARING=X: the
#                                         # coordinator's --gpu-sharing (_gsX); TINY_GRAPHS=1: the gateway's
#                                         # --tiny-cuda-graphs (_tgraphs); MPS=1 (any part): the processes
#                                         # share the GPU through a CUDA MPS server (below; _mps)
#   bash benchmarks/gpu_suite.sh balance-profile   # 1.3B 1 step: ms per chunk of every block and VAE unit, one GPU
#   bash benchmarks/gpu_suite.sh balance-even balance-auto   # 1.3B 1 step, 60 s: the even partition 15,15 with
#                                         # the VAE cut by MACs, then --partition auto from that profile (read
#                                         # from $OUT, else benchmarks/results); ~5 min per part
#
# Results go to ${OUT:-benchmarks/results}/v2_*.json; `python -m benchmarks.report` makes BENCHMARKS.md's tables
# from them. The commit is read from $STAGECAST_COMMIT and the dirty flag from $STAGECAST_DIRTY when the tree has no
# .git. Main streams are 60 s of video (DESIGN.md section 4).
set -uo pipefail
out="${OUT:-benchmarks/results}"
# STAGES=1 runs the parts that take it (quick, 1.3b, 1.3b-4, 14b, 5b, warmup-ab, v2v, slo, webrtc, fp8,
# vae-graphs-1.3b, kv-admission*, capacity-*) as one stage on one GPU; their JSON names then say 1gpu.  The parity parts (check, sp-*, cfg-*)
# need two GPUs whatever it says.
stages="${STAGES:-2}"
case "$stages" in 1|2) ;; *) echo "gpu_suite: STAGES must be 1 or 2, not '$stages'"; exit 2 ;; esac

need_torchao() {  # --fp8 needs torchao: the carried wheel, installed once beside whatever else is on PYTHONPATH
  python -c "import torchao" 2>/dev/null && return 0
  python -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-fp8 .whl-fp8/*.whl || return 1
  export PYTHONPATH="/tmp/site-fp8${PYTHONPATH:+:$PYTHONPATH}"
}
mkdir -p "$out"
# The SDK is its own distribution (clients/python); a checkout that has not installed it reads it from there.
python -c "import stagecast_client" 2>/dev/null || export PYTHONPATH="$PWD/clients/python${PYTHONPATH:+:$PYTHONPATH}"
harness=(python -m benchmarks.harness --cuda-graphs --vae-compile)
# MPS=1: the processes share each GPU through a CUDA MPS server started here (their kernels run side by side rather
# than time-slicing the GPU), stopped when the suite ends; the results record it (args.cuda_mps, JSON names _mps).
if [ -n "${MPS:-}" ]; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/stagecast-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/stagecast-mps/log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d || { echo "gpu_suite: MPS=1, but nvidia-cuda-mps-control -d failed"; exit 2; }
  trap 'echo quit | nvidia-cuda-mps-control' EXIT
fi

for part in "$@"; do
  case "$part" in
    check)
      s=(timeout 150 python -m launcher.cli selftest --device cuda --cuda-graphs)
      "${s[@]}" --dtype bfloat16 --window 3 --sink 1 --chunks 6
      "${s[@]}" --dtype bfloat16 --model wan2.1-1.3b --layers 4 --height 60 --width 104 --window 3 --sink 1 --chunks 6
      "${s[@]}" --dtype float32 --policy clean --window 2 --chunks 5 --partition 1,3
      timeout 120 python -m benchmarks.graphs_check
      ;;
    quick)
      timeout 240 "${harness[@]}" --model wan2.1-1.3b --steps 1 --stages "$stages" --seconds 15 --first-seconds 4 \
        --ttff-runs 2 --interactive-updates 2 --load 2 --load-seconds 4 --peer-chunks 4 --json "$out/quick_${stages}gpu.json"
      ;;
    1.3b)
      timeout 330 "${harness[@]}" --model wan2.1-1.3b --steps 1 --stages "$stages" --load 1,2,4,8 --load-seconds 10 \
        --json "$out/v2_13b_1step_${stages}gpu.json"
      ;;
    tiny)
      timeout 520 "${harness[@]}" --model wan2.1-1.3b --steps 1 --stages "$stages" --decoder full,tiny --no-compiled-peer \
        --peer-chunks 4 --ttff-runs 3 --json "$out/v2_13b_1step_${stages}gpu_tiny.json"
      ;;
    decoders)
      timeout 300 python -m benchmarks.decoder_bench --vae-batched --json "$out/decoder_bench_1gpu.json"
      ;;
    vae-graphs)
      timeout 560 python -m benchmarks.vae_graphs_check --json "$out/vae_graphs_check.json"
      ;;
    vae-graphs-1.3b)
      timeout 330 "${harness[@]}" --vae-cuda-graphs --model wan2.1-1.3b --steps 1 --stages "$stages" --load 1,2,4,8 \
        --load-seconds 10 --json "$out/v2_13b_1step_${stages}gpu_vaegraphs.json"
      ;;
    warmup-ab)
      for w in on off; do
        flags=(); [ "$w" = off ] && flags=(--no-pipeline-warmup)
        timeout 270 "${harness[@]}" --model wan2.1-1.3b --steps 4 --stages "$stages" --seconds 10 --first-seconds 10 \
          --ttff-runs 2 --interactive-updates 1 --no-compiled-peer --peer-chunks 2 "${flags[@]}" \
          --json "$out/v2_13b_4step_${stages}gpu_warmup_$w.json"
      done
      ;;
    1.3b-4)
      timeout 250 "${harness[@]}" --model wan2.1-1.3b --steps 4 --stages "$stages" --no-compiled-peer \
        --json "$out/v2_13b_4step_${stages}gpu.json"
      ;;
    14b)
      timeout 285 "${harness[@]}" --model wan2.1-14b --steps 1 --stages "$stages" --peer-chunks 4 --ttff-runs 3 \
        --no-compiled-peer --json "$out/v2_14b_1step_${stages}gpu.json"
      ;;
    5b)
      timeout 360 "${harness[@]}" --model wan2.2-ti2v-5b --width 1280 --height 704 --steps 4 --stages "$stages" \
        --peer-chunks 4 --ttff-runs 3 --no-compiled-peer --json "$out/v2_5b_4step_${stages}gpu.json"
      ;;
    sp-check)
      s=(timeout 150 python -m launcher.cli selftest --device cuda --stages 1 --sp 2)
      "${s[@]}" --dtype float32 --window 3 --sink 1 --chunks 5
      "${s[@]}" --dtype bfloat16 --model wan2.1-1.3b --layers 4 --height 60 --width 104 --window 3 --sink 1 --chunks 5
      timeout 200 python -m benchmarks.sp_bench --gpus 2 --json "$out/sp_a2a_2gpu.json"
      ;;
    sp-1.3b|sp-14b|pp-1.3b-eager|pp-14b-eager)
      model=wan2.1-1.3b; tag=13b; extra=()
      case "$part" in *14b*) model=wan2.1-14b; tag=14b; extra=(--ttff-runs 3) ;; esac
      topo=(--stages 1 --sp 2); name=sp2
      case "$part" in pp-*) topo=(--stages 2); name=pp2 ;; esac
      timeout 290 python -m benchmarks.harness --vae-compile --model "$model" --steps 1 --peer-chunks 4 \
        --no-compiled-peer --load 1 --load-seconds 5 "${extra[@]}" "${topo[@]}" \
        --json "$out/v2_${tag}_1step_${name}_eager.json"
      ;;
    v2v)
      timeout 570 python -m benchmarks.v2v_bench --cuda-graphs --vae-compile --model wan2.1-1.3b --width 832 \
        --height 480 --steps 2 --stages "$stages" --json "$out/v2v_13b_2step_${stages}gpu.json"
      ;;
    slo)
      slo_load=2,4,6,8,10; [ "$stages" = 1 ] && slo_load=1,2,3,5  # one GPU holds about half as many
      # Load rows paced at 16 FPS with the SLO controller choosing 1..4 steps; 10 streams is past the expected
      # capacity, so its row shows refusals (RESOURCE_EXHAUSTED) and capacity_streams the most streams held.
      # The SLO model starts from the stages' calibration at READY and the gateway's measured VAE decode (the slowest
      # VAE part per chunk); the JSON's slo_model says what it counted. --slo-vae-ms N would fix the VAE cost instead.
      timeout 540 "${harness[@]}" --model wan2.1-1.3b --steps 4 --load-min-steps 1 --stages "$stages" --seconds 20 \
        --first-seconds 4 --ttff-runs 3 --interactive-updates 2 --load "$slo_load" --load-seconds 20 \
        --no-compiled-peer --peer-chunks 4 --json "$out/v2_13b_slo_${stages}gpu.json"
      ;;
    webrtc)
      if ! python -c "import aiortc, aiohttp" 2>/dev/null; then
        python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-web \
          wheels/py312/*.whl && export PYTHONPATH="/tmp/site-web:${PYTHONPATH:-}"
      fi
      timeout 560 python -m benchmarks.webrtc --cuda-graphs --vae-compile --model wan2.1-1.3b --steps 1 --stages "$stages" \
        --seconds 15 --runs 2 --strength 500 --v2v-steps 2 --json "$out/webrtc_13b_1step_${stages}gpu.json"
      ;;
    cfg-check)
      timeout 200 python -m launcher.cli selftest --device cuda --stages 1 --cfg-parallel 2 --guidance 5,1 \
        --prompt-update --dtype float32 --steps 2 --chunks 6
      ;;
    cfg-seq)
      timeout 290 "${harness[@]}" --model wan2.1-1.3b --steps 1 --stages 2 --guidance 5 --no-compiled-peer \
        --ttff-runs 3 --json "$out/v2_13b_1step_cfg5_seq_pp2.json"
      ;;
    cfg-par)
      timeout 290 "${harness[@]}" --model wan2.1-1.3b --steps 1 --stages 1 --cfg-parallel 2 --guidance 5 \
        --no-compiled-peer --ttff-runs 3 --json "$out/v2_13b_1step_cfg5_cfgpar2.json"
      ;;
    fp8-check)
      need_torchao || { echo "fp8-check: torchao is not installed and .whl-fp8/ has no wheel"; exit 1; }
      timeout 300 python -m benchmarks.fp8_check --models wan2.1-1.3b,wan2.1-14b --json "$out/fp8_check.json"
      ;;
    dit-levers)
      timeout 420 python -m benchmarks.dit_levers --json "$out/dit_levers_1gpu.json"
      ;;
    attention-check)
      timeout 500 python -m benchmarks.attention_check --json "$out/attention_check.json"
      ;;
    host-sync)
      timeout 300 python -m benchmarks.host_sync --dit-levers "${DIT_LEVERS:-fused@rows}" --batches 1,4 \
        --json "$out/host_sync_1gpu.json"
      ;;
    fp8)
      need_torchao || { echo "fp8: torchao is not installed and .whl-fp8/ has no wheel"; exit 1; }
      timeout 300 "${harness[@]}" --fp8 --model wan2.1-1.3b --steps 1 --stages "$stages" --no-compiled-peer --peer-chunks 4 \
        --ttff-runs 3 --json "$out/v2_13b_1step_${stages}gpu_fp8.json"
      ;;
    pp4|pp4-14b|pp2sp2|pp2cfg2)
      gpus=$(python -c "import torch; print(torch.cuda.device_count())")
      model=wan2.1-1.3b; tag=13b; topo=(--stages 4); name=pp4; extra=(--load 1,2,4,8 --load-seconds 10)
      run=("${harness[@]}")
      case "$part" in
        pp4-14b) model=wan2.1-14b; tag=14b; extra=(--ttff-runs 3) ;;
        pp2sp2) topo=(--stages 2 --sp 2); name=pp2sp2_eager; extra=()  # SP stages have no CUDA graphs yet
                run=(python -m benchmarks.harness --vae-compile) ;;
        pp2cfg2) topo=(--stages 2 --cfg-parallel 2 --guidance 5); name=pp2cfg2_cfg5; extra=() ;;
      esac
      timeout 560 "${run[@]}" --model "$model" --steps 1 --no-compiled-peer --peer-chunks 4 "${topo[@]}" \
        "${extra[@]}" --json "$out/v2_${tag}_1step_${name}_${gpus}gpu.json"
      ;;
    kv-admission|kv-admission-1step)
      steps=4; [ "$part" = kv-admission-1step ] && steps=1
      timeout 560 python -m benchmarks.kv_admission_check --model wan2.1-1.3b --stages "$stages" --steps "$steps" \
        --seconds 15 --max-open 12 --cuda-graphs --vae-compile --json "$out/kv_admission_13b_${steps}step_${stages}gpu.json"
      ;;
    capacity-1.3b|capacity-1.3b-2|capacity-1.3b-4|capacity-14b|capacity-5b)
      # Capacity rows only (harness --capacity): each part skips the first stream, TTFF, the interactive stream and
      # the peers; the JSON is written as each decoder's row finishes (<json>.partial) and, when `timeout` cuts
      # the run, as a result marked partial.
      # SLO_VAE_MS=N (the full VAE) or KIND=MS[,KIND=MS] prices each stream's decode at that many ms per chunk
      # (--slo-vae-ms; a what-if over the gateway's measurements; JSON names end _vae<value>ms, '=' and ',' as '-').
      cap=(--capacity --capacity-seconds 20 --first-seconds 0 --ttff-runs 0 --interactive-updates 0 --no-peers)
      sfx=""; [ -n "${SLO_VAE_MS:-}" ] && { cap+=(--slo-vae-ms "$SLO_VAE_MS"); v="${SLO_VAE_MS//=/-}"; sfx="_vae${v//,/-}ms"; }
      if [ "${PACE_GRID:-1}" = 0 ]; then cap+=(--no-pace-grid); else sfx="${sfx}_grid"; fi
      [ -n "${LOOKAHEAD:-}" ] && { cap+=(--lookahead "$LOOKAHEAD"); sfx="${sfx}_la${LOOKAHEAD}"; }
      [ -n "${DIT_LEVERS:-}" ] && { cap+=(--dit-levers "$DIT_LEVERS"); sfx="${sfx}_${DIT_LEVERS//[,@]/-}"; }
      [ -n "${BATCH:-}" ] && { cap+=(--batch "$BATCH"); sfx="${sfx}_b${BATCH}"; }
      [ -n "${GPU_SHARING:-}" ] && { cap+=(--gpu-sharing "$GPU_SHARING"); sfx="${sfx}_gs${GPU_SHARING}"; }
      [ -n "${MPS:-}" ] && sfx="${sfx}_mps"
      [ -n "${TINY_GRAPHS:-}" ] && { cap+=(--tiny-cuda-graphs); sfx="${sfx}_tgraphs"; }
      t=420; [ -n "${BURST:-}" ] && { cap+=(--burst "$BURST"); sfx="${sfx}_burst${BURST}"; t=540; }
      dec="${DECODERS:-tiny,full}"; [ -n "${DECODERS:-}" ] && sfx="${sfx}_${DECODERS//,/-}"
      case "$part" in
        capacity-1.3b)
          timeout "$t" "${harness[@]}" "${cap[@]}" --model wan2.1-1.3b --steps 1 --stages "$stages" \
            --decoder "$dec" --capacity-max 14 --seconds 0 --json "$out/v2_cap_13b_1step_${stages}gpu${sfx}.json" ;;
        capacity-1.3b-2)
          timeout "$t" "${harness[@]}" "${cap[@]}" --model wan2.1-1.3b --steps 2 --stages "$stages" \
            --decoder "$dec" --capacity-max 14 --seconds 0 --json "$out/v2_cap_13b_2step_${stages}gpu${sfx}.json" ;;
        capacity-1.3b-4)
          timeout "$t" "${harness[@]}" "${cap[@]}" --model wan2.1-1.3b --steps 4 --load-min-steps 1 \
            --stages "$stages" --decoder "$dec" --capacity-max 14 --seconds 0 \
            --json "$out/v2_cap_13b_slo4_${stages}gpu${sfx}.json" ;;
        capacity-14b)
          # Stages eager: a graphed 14B forward is no faster (123 vs 119 ms per chunk, attention_14b_b12_1gpu.json),
          # and on one GPU the graphs' buffer cap left 5.9 GiB for KV, less than one 6-frame window (8.3 GiB).
          timeout 540 python -m benchmarks.harness --vae-compile "${cap[@]}" --model wan2.1-14b --steps 1 --stages "$stages" --decoder tiny \
            --capacity-max 8 --seconds 20 --json "$out/v2_cap_14b_1step_${stages}gpu${sfx}.json" ;;
        capacity-5b)
          timeout 480 "${harness[@]}" "${cap[@]}" --model wan2.2-ti2v-5b --width 1280 --height 704 --steps 1 \
            --stages "$stages" --decoder tiny --capacity-max 10 --seconds 0 \
            --json "$out/v2_cap_5b_1step_${stages}gpu${sfx}.json" ;;
      esac
      ;;
    sdpa-backends)
      timeout 150 python -m benchmarks.sdpa_backends --json "$out/sdpa_backends_1gpu.json"
      ;;
    fused-kernels)
      timeout 240 python -m benchmarks.fused_kernels --json "$out/fused_kernels_1gpu.json"
      ;;
    balance-profile)
      timeout 560 python -m benchmarks.balance --model wan2.1-1.3b --steps 1 --cuda-graphs --vae-compile \
        --out "$out/balance_13b_1step.json"
      ;;
    balance-even|balance-auto)
      flags=(--partition 15,15); name=even  # even, said explicitly so that its row is named apart from `1.3b`'s
      if [ "$part" = balance-auto ]; then
        profile="$out/balance_13b_1step.json"
        [ -f "$profile" ] || profile=benchmarks/results/balance_13b_1step.json
        flags=(--partition auto --balance-profile "$profile"); name=auto
      fi
      timeout 330 "${harness[@]}" --model wan2.1-1.3b --steps 1 --stages 2 --no-compiled-peer --ttff-runs 2 \
        --interactive-updates 2 --peer-chunks 4 "${flags[@]}" --json "$out/v2_13b_1step_2gpu_balance_${name}.json"
      ;;
    *)
      sed -n '2,/^set -uo/{/^set -uo/!p}' "$0"
      exit 2
      ;;
  esac
done

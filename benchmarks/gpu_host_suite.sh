#!/bin/bash
# The speed comparisons of the README's GPU-host rows in one run, against llama.cpp on the same files.
#
#   bash benchmarks/gpu_host_suite.sh WORK LLAMA_BIN [PARTS]
#
# WORK: a folder with ~60 GB free (synth files and the quantize benchmark model are written there once and
# reused); LLAMA_BIN: the bin/ folder of a llama.cpp CUDA build (../shared/tools/build_llamacpp.sh build DEST
# cuda SRC); PARTS: any of cuda,profile,cpu,threads,hybrid,uncached,quantize (default: all), comma-separated.
# Each part prints its table and writes JSON under WORK/results/. The CPU rows hide the GPU from both programs
# (CUDA_VISIBLE_DEVICES=), so llama.cpp's CUDA build runs its CPU code. uncached needs no llama.cpp: the hybrid
# 4 GiB row over a host expert cache with the file's pages dropped (16 reader threads with and without read
# ahead, then none), its host side replayed with and without read ahead, the disk's rate for a decode step's
# reads, and the host cache's two requesters at once.
set -eu
WORK=${1:?usage: gpu_host_suite.sh WORK LLAMA_BIN [PARTS]}
BIN=${2:?usage: gpu_host_suite.sh WORK LLAMA_BIN [PARTS]}
PARTS=${3:-cuda,profile,cpu,threads,hybrid,uncached,quantize}
HERE=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$WORK/results"
cores=$(nproc)
want() { [[ ",$PARTS," == *",$1,"* ]]; }
synth() {  # synth NAME [--layers N]: the 35B-A3B-geometry Q4_K file, written once
  [ -f "$WORK/$1" ] || python3 -m forge synth -o "$WORK/$1" --geometry qwen3.6-35b-a3b --type q4_k "${@:2}"
}
cd "$HERE"
if want cuda || want profile || want hybrid || want uncached; then synth q35.gguf; fi
if want cpu || want threads; then synth q35-l4.gguf --layers 4; fi
if want cuda; then
  echo "== resident on the GPU, pp512 / tg128, forge and llama.cpp"
  python3 benchmarks/runtime_speed.py "$WORK/q35.gguf" --device cuda --resident-only --no-transformers --reps 3 \
    --llama-bench "$BIN/llama-bench" --json "$WORK/results/cuda.json"
fi
if want profile; then
  echo "== one prefill's GPU time by kernel and by product; the GEMM precisions"
  python3 benchmarks/prefill_precision.py "$WORK/q35.gguf" --profile
  python3 benchmarks/prefill_precision.py "$WORK/q35.gguf" --precisions auto,tf32x3,bf16x3 --reps 2
fi
if want cpu; then
  echo "== the CPU, all cores, pp128 / tg64, forge and llama.cpp"
  CUDA_VISIBLE_DEVICES= python3 benchmarks/runtime_speed.py "$WORK/q35-l4.gguf" --device cpu --threads "$cores" \
    --resident-only --no-transformers --pp 128 --tg 64 --reps 3 --llama-bench "$BIN/llama-bench" \
    --json "$WORK/results/cpu.json"
fi
if want threads; then
  echo "== the LM-head product at 1..$cores threads, forge's tuning and the host's own"
  CUDA_VISIBLE_DEVICES= python3 benchmarks/cpu_threads.py "$WORK/q35-l4.gguf" --cpu-names default,native \
    --rounds 2 --json "$WORK/results/threads.json"
fi
if want hybrid; then
  echo "== routed experts beyond the GPU: hybrid pools of 1/4/8 GiB, SSD streaming, llama.cpp -ot exps=CPU"
  python3 benchmarks/hybrid_experts.py "$WORK/q35.gguf" --llama-bench "$BIN/llama-bench" \
    --json "$WORK/results/hybrid.json"
  echo "== the same hybrid 4 GiB row with the CPU side on 8-bit activations (--q8-activations)"
  FORGE_Q8_ACTIVATIONS=1 python3 benchmarks/hybrid_experts.py "$WORK/q35.gguf" --caches-gib 4 --rows hybrid \
    --json "$WORK/results/hybrid-q8.json"
fi
if want uncached; then
  echo "== the file not in the page cache: hybrid 4 GiB over an 8 GiB host expert cache, trace routing"
  python3 benchmarks/hybrid_experts.py "$WORK/q35.gguf" --rows hybrid --routing trace --caches-gib 4 \
    --host-cache-gib 8 --pp 32 --tg 32 --reps 2 --warmup 8 --warmup-prefills 1 --read-threads 16 --prefetch \
    --json "$WORK/results/uncached-readers16.json"
  python3 benchmarks/hybrid_experts.py "$WORK/q35.gguf" --rows hybrid --routing trace --caches-gib 4 \
    --host-cache-gib 8 --pp 32 --tg 32 --reps 2 --warmup 8 --warmup-prefills 1 --read-threads 0 \
    --json "$WORK/results/uncached-readers0.json"
  python3 benchmarks/read_ahead.py "$WORK/q35.gguf" --tokens 64 --warmup 16 --unhinted \
    --json "$WORK/results/read_ahead.json"
  python3 benchmarks/disk_reads.py "$WORK/q35.gguf" --threads 0,4,16 --chunk-kb 0 --misses 1,4 \
    --json "$WORK/results/disk_reads.json"
  python3 benchmarks/cache_contention.py "$WORK/q35.gguf" --hot 16 --drop-pages --json "$WORK/results/contention.json"
fi
if want quantize; then
  echo "== quantize the 5 B-parameter benchmark model: forge on the CPU and the GPU, llama-quantize"
  python3 benchmarks/quantize_model.py "$WORK/qm" --runners forge-cpu forge-cuda llama \
    --presets q4_k_m q6_k iq4_xs iq2_xxs+imat --threads "$cores" --llama-quantize "$BIN/llama-quantize"
fi

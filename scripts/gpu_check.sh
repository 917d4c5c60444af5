#!/usr/bin/env bash
# The GPU check of the cuda backend, in one command on a CUDA host (no network needed):
# build the kernels (timed), the CUDA tests, a float32 varlen probe, the op and engine benchmarks,
# compute-sanitizer on the kernel tests, and the cpu backend's dtype benchmark on the host CPU.
# Each step has its own time limit and the whole run a budget: a step that would not fit is
# skipped and says so, a hung one is killed, and the rest still run. Each step's log and the JSON
# go into OUT_DIR/gpu_check.tgz, the summary into OUT_DIR/summary.txt.
#
#   bash scripts/gpu_check.sh OUT_DIR [BUDGET_S] [STEP ...]
#
# STEP: info build tests probe ops cpu engine sanitizer (default: all, in that order); also
# trace (bench_gpu.py's one-sequence decode under torch's profiler, a Chrome trace per way to
# decode: the host's share of an eager step), profile (where a Llama-3-8B-shaped decode step's
# time goes on the GPU), layers (the same decode profile and the prefill's, with the fused layers and with
# the model's reference layers, LAYERS_ROUNDS times, default 1; each run loads the model: about 40 s), cpuprofile (where a prefill's, with the
# template and without, and a decode step's time go in the cpu backend, in each dtype, on the host CPU at 2 threads,
# a 2-vCPU machine's count, and at 16; the bf16 prefill also on the inner product instead of AMX's brgemm), linear (scripts/bench_cpu_linear.py in bf16:
# the float32 kernel, torch's bf16 linears and the service's bf16 kernels), cpubf16 (the bf16
# CPU tests, then each linear kernel's cost per call (brgemm also in the block widths
# BRGEMM_COLUMNS names, e.g. 64,128), the template products' cost per call on AMX tiles and on
# the AVX512-BF16 dot products, a decode step in bf16 by default (brgemm on AMX), in float32, on
# brgemm, without the few-row kernel, with the template attention (and a long prompt's own) on the dot
# products and on the inner product with int8 weights (model.quantization), and the dtype benchmark (bf16 also with those products), each at 2 threads, a 2-vCPU
# machine's count, then at 16), amxattn (what the bf16 start-up timing keeps on AMX, template attention and
# linears, at 2 threads and 16, and its tests; the key-row walk's cost per call against the dot products'
# two walks; a bf16 prefill's and decode step's profile with the AMX defaults before the timing (brgemm
# linears, native template attention), with the timed defaults and with the matrix products forced, at 2
# threads and 16; and the dtype benchmark at 2, the timed defaults against those before)
# and omp (which OpenMP runtimes the cpu backend's libraries load, and the bf16 decode under each OMP_WAIT_POLICY).
# SANITIZE_TESTS and SANITIZE_K: the test files compute-sanitizer runs and their -k expression (default:
# the store, concat and copy kernels and the cascade decode, tests/test_cuda_ops.py and test_attention_cuda.py).
# Env: CPU_MODEL_DIR, a directory with a model's config.json and tokenizer (no weights needed:
# random ones are made) for the cpu step; default: the default model where prepare-model finds it.
set -u
OUT=${1:?usage: gpu_check.sh OUT_DIR [BUDGET_S] [STEP ...]}
BUDGET=${2:-480}
shift $(( $# >= 2 ? 2 : 1 ))
STEPS=${*:-info build tests probe ops cpu engine sanitizer}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOGS=$(mktemp -d)
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
START=$SECONDS
SUMMARY=()

step() {  # step NAME LIMIT_S COMMAND...: run with the smaller of LIMIT_S and what is left of the budget
  local name=$1 limit=$2; shift 2
  case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  local left=$(( BUDGET - (SECONDS - START) - 5 ))
  (( limit > left )) && limit=$left
  if (( limit < 15 )); then SUMMARY+=("$name: skipped (${left}s of the budget left)"); return 0; fi
  echo "=== $name (limit ${limit}s) $(date -u +%H:%M:%S)"
  local t0=$SECONDS
  timeout -k 5 "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$LOGS/$name.log"
  SUMMARY+=("$name: rc=$rc in $(( SECONDS - t0 ))s$( ((rc == 124 || rc == 137)) && echo ' (time limit)')")
}

step info 30 bash -c 'nvidia-smi -L; nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv;
  lscpu | grep -E "Model name|^CPU\(s\)"; echo "ISA: $(grep -o -w -E "amx_bf16|amx_tile|avx512_bf16|avx512f|avx2" /proc/cpuinfo | sort -u | tr "\n" " ")";
  python3 -c "import torch, triton, transformers; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"triton\", triton.__version__, \"transformers\", transformers.__version__)";
  nvcc --version | tail -n 2; which ninja g++ compute-sanitizer'
step build 240 python3 -c 'import time; t = time.perf_counter(); from cuda_ops import load_cuda_ops; load_cuda_ops(); print(f"cuda_ops built and loaded in {time.perf_counter() - t:.1f} s")'
step tests 200 python3 -m pytest -q -rs -p no:cacheprovider -o addopts= tests/test_cuda_ops.py tests/test_attention_cuda.py \
  tests/test_cuda_fused.py
step probe 60 python3 - <<'EOF'
import torch
from torch.nn.attention.varlen import varlen_attn
q = torch.randn(8, 4, 64, device="cuda")
cu = torch.tensor([0, 8], dtype=torch.int32, device="cuda")
for dtype in (torch.float32, torch.bfloat16):
    try:
        varlen_attn(q.to(dtype), q.to(dtype), q.to(dtype), cu, cu, 8, 8)
        print(f"varlen_attn {dtype}: runs")
    except Exception as exc:
        print(f"varlen_attn {dtype}: {type(exc).__name__}: {str(exc)[:200]}")
EOF
step ops 90 bash -c 'python3 scripts/bench_cuda_ops.py --iters 10 --json '"$LOGS"'/cuda_ops.json
  python3 scripts/bench_cuda_layers.py --iters 10 --json '"$LOGS"'/cuda_layers.json' 
SANITIZE_DEFAULT_K="(kernel_matches_reference and bfloat16 and 128) or copy_blocks_kernel or many_sequences or cascade_decode_on_gpu"
CPU_MODEL=${CPU_MODEL_DIR:+--model $CPU_MODEL_DIR --load-format dummy}
step cpu 120 python3 scripts/bench_cpu_dtype.py $CPU_MODEL --rounds 1 --singles 3 --concurrency 16,64 --json "$LOGS/cpu_dtype.json"
step engine 180 python3 scripts/bench_gpu.py --requests ${GPU_REQUESTS:-5} --decode-tokens ${GPU_DECODE_TOKENS:-32} --json "$LOGS/gpu.json"
step trace 150 python3 scripts/bench_gpu.py --requests 2 --decode-batches 1 --decode-tokens 8 --trace "$LOGS/traces"
step profile 180 bash -c 'set -e; L=$(mktemp -d)
  python3 -c "import sys; from pathlib import Path; from prefix_service.synthetic import LLAMA3_8B, build_config_only, build_tokenizer
build_config_only(Path(sys.argv[1]) / \"model\", build_tokenizer(Path(sys.argv[1]) / \"tok\"), \"llama\", **LLAMA3_8B)" "$L"
  for graphs in 256 0; do echo "--- model.cuda_graph_max_batch $graphs"
    python3 scripts/profile_decode.py --model "$L/model" --load-format dummy --backend cuda --device cuda --dtype bfloat16 \
      --kv-cache-memory 16GiB --cuda-graph-max-batch $graphs --batches 1,16,64 --steps 5; done'
step layers 300 bash -c 'set -e; L=$(mktemp -d)
  python3 -c "import sys; from pathlib import Path; from prefix_service.synthetic import LLAMA3_8B, build_config_only, build_tokenizer
build_config_only(Path(sys.argv[1]) / \"model\", build_tokenizer(Path(sys.argv[1]) / \"tok\"), \"llama\", **LLAMA3_8B)" "$L"
  for round in $(seq ${LAYERS_ROUNDS:-1}); do for fused in 1 0; do echo "--- round $round, model.cuda_fused_layers $fused"
    python3 scripts/profile_decode.py --model "$L/model" --load-format dummy --backend cuda --device cuda --dtype bfloat16 \
      --kv-cache-memory 16GiB --cuda-fused-layers $fused --batches 1,16,64 --steps 5 | tail -n 4
    python3 scripts/profile_prefill.py --model "$L/model" --load-format dummy --backend cuda --device cuda --dtype bfloat16 \
      --kv-cache-memory 16GiB --cuda-fused-layers $fused --runs 5 | tail -n 3; done; done'
step cpuprofile 360 bash -c 'for threads in 2 16; do for way in float32 bfloat16 bf16-inner; do echo "--- $threads threads, $way"
    vars=; dtype=bfloat16; case $way in float32) dtype=float32 ;; bf16-inner) vars=PREFIX_SERVICE_BF16_LINEAR=inner_product ;; esac
    env OMP_NUM_THREADS=$threads $vars python3 scripts/profile_prefill.py ${CPU_MODEL_DIR:+--model $CPU_MODEL_DIR --load-format dummy} \
      --backend cpu --device cpu --dtype $dtype --runs 5 --profile-runs 1 --paths prefix,no_prefix 2>&1 | tail -n 4
    [ $way = bf16-inner ] || env OMP_NUM_THREADS=$threads python3 scripts/profile_decode.py \
      ${CPU_MODEL_DIR:+--model $CPU_MODEL_DIR --load-format dummy} --backend cpu --device cpu --dtype $dtype \
      --batches 1,16,64 --steps 5 2>&1 | tail -n 5; done; done'
step linear 90 python3 scripts/bench_cpu_linear.py --dtype bfloat16 --rows 1,16,64,256 --passes 5 --json "$LOGS/cpu_linear_bf16.json"
step cpubf16 480 bash -c 'python3 -m pytest -q -p no:cacheprovider -o addopts= tests/test_cpu_onednn.py tests/test_cpu_bf16.py tests/test_cpu_stack.py tests/test_quantize.py
  python3 scripts/bench_cpu_linear_call.py --threads 2,16 --rows 1,8,16,32,64 --calls 100 ${BRGEMM_COLUMNS:+--brgemm-columns $BRGEMM_COLUMNS} --json '"$LOGS"'/cpu_linear_call.json
  for products in auto dot; do PREFIX_SERVICE_BF16_TEMPLATE_PRODUCTS=$products python3 scripts/bench_cpu_template_call.py \
    --rows 6,48,150,300 --calls 300 --json '"$LOGS"'/cpu_template_call_$products.json; done
  for threads in 2 16; do for way in default float32 brgemm no-few-rows default+dot inner+int8; do echo "--- $threads threads, $way"
    case $way in brgemm) vars=PREFIX_SERVICE_BF16_LINEAR=brgemm ;; no-few-rows) vars=PREFIX_SERVICE_BF16_FEW_ROWS=0 ;;
      default+dot) vars=PREFIX_SERVICE_BF16_TEMPLATE_PRODUCTS=dot ;; inner+int8) vars=PREFIX_SERVICE_BF16_LINEAR=inner_product ;;
      *) vars= ;; esac
    env OMP_NUM_THREADS=$threads $vars python3 scripts/profile_decode.py \
      ${CPU_MODEL_DIR:+--model $CPU_MODEL_DIR --load-format dummy} --backend cpu --device cpu \
      --quantization $( [ $way = inner+int8 ] && echo int8 || echo none ) \
      --dtype $( [ $way = float32 ] && echo float32 || echo bfloat16 ) --batches 1,4,16,64 --steps 5 2>&1 | tail -n 5; done; done
  for threads in 2 16; do echo "--- bench_cpu_dtype, $threads threads"
    OMP_NUM_THREADS=$threads python3 scripts/bench_cpu_dtype.py ${CPU_MODEL_DIR:+--model $CPU_MODEL_DIR --load-format dummy} \
      --system bf16-dot:bfloat16:PREFIX_SERVICE_BF16_TEMPLATE_PRODUCTS=dot \
      --rounds 1 --singles 3 --concurrency 16,64 --json '"$LOGS"'/cpu_dtype_t$threads.json; done'
step amxattn 420 bash -c 'python3 -m pytest -q -p no:cacheprovider -o addopts= tests/test_cpu_onednn.py -k "template or brgemm"
  python3 -m pytest -q -p no:cacheprovider -o addopts= tests/test_cpu_bf16.py -k prefix_equals_no_prefix
  python3 -m pytest -q -p no:cacheprovider -o addopts= tests/test_cpu_tuning.py
  python3 scripts/time_kernel_choices.py ${CPU_MODEL_DIR:+--model $CPU_MODEL_DIR --load-format dummy} \
    --thread-counts 2,16 --repeat 2 --json '"$LOGS"'/amx_kernel_choices.json
  for way in auto dot dot-rows; do echo "--- template call, products $way"
    PREFIX_SERVICE_BF16_TEMPLATE_PRODUCTS=${way%-rows} python3 scripts/bench_cpu_template_call.py --rows 3,24,64,152,300 \
      --calls 200 $( [ $way = dot-rows ] && echo --key-rows ) --json '"$LOGS"'/amx_template_call_$way.json | tail -n 6; done
  before="PREFIX_SERVICE_BF16_LINEAR=brgemm PREFIX_SERVICE_BF16_TEMPLATE_ATTENTION=native"
  for threads in 2 16; do for way in before default matrix; do echo "--- $threads threads, bf16, $way"
    case $way in before) vars=$before ;; matrix) vars=PREFIX_SERVICE_BF16_TEMPLATE_ATTENTION=matrix ;; *) vars= ;; esac
    env OMP_NUM_THREADS=$threads $vars python3 scripts/profile_prefill.py \
      ${CPU_MODEL_DIR:+--model $CPU_MODEL_DIR --load-format dummy} --backend cpu --device cpu --dtype bfloat16 --runs 5 \
      --profile-runs 1 --paths prefix 2>&1 | tail -n 3
    env OMP_NUM_THREADS=$threads $vars python3 scripts/profile_decode.py \
      ${CPU_MODEL_DIR:+--model $CPU_MODEL_DIR --load-format dummy} --backend cpu --device cpu --dtype bfloat16 \
      --batches 1,16,64 --steps 5 2>&1 | tail -n 5; done; done
  OMP_NUM_THREADS=2 python3 scripts/bench_cpu_dtype.py ${CPU_MODEL_DIR:+--model $CPU_MODEL_DIR --load-format dummy} \
    --dtypes bfloat16 --system bf16-before:bfloat16:${before// /,} \
    --rounds 1 --singles 3 --concurrency 16,64 --json '"$LOGS"'/amx_cpu_dtype_t2.json'
step omp 120 bash -c 'ls "$(python3 -c "import os, torch; print(os.path.dirname(torch.__file__))")/lib" | grep -i omp
  python3 -c "import torch; from prefix_service.backends.cpu import native, onednn; native.load(); onednn.load(); print(sorted({l.split()[-1] for l in open(\"/proc/self/maps\") if \"omp\" in l}))"
  for run in "bfloat16 default" "bfloat16 active" "bfloat16 passive" "float32 default"; do set -- $run; echo "--- $1, OMP_WAIT_POLICY=$2"
    env $( [ $2 != default ] && echo OMP_WAIT_POLICY=$2 ) python3 scripts/profile_decode.py ${CPU_MODEL_DIR:+--model $CPU_MODEL_DIR --load-format dummy} \
      --backend cpu --device cpu --dtype $1 --batches 1,16 --steps 5 2>&1 | tail -n 3; done'
step sanitizer 120 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 3 python3 -m pytest -q -x -p no:cacheprovider -o addopts= \
  ${SANITIZE_TESTS:-tests/test_cuda_ops.py tests/test_attention_cuda.py} -k "${SANITIZE_K:-$SANITIZE_DEFAULT_K}"

echo "=== summary ($(( SECONDS - START ))s)"
printf '%s\n' "${SUMMARY[@]}" | tee "$OUT/summary.txt"
cp "$OUT/summary.txt" "$LOGS/" && tar -czf "$OUT/gpu_check.tgz" -C "$LOGS" .

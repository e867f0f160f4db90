#!/usr/bin/env bash
# The GPU machine's check: configure against the LibTorch inside that machine's Python torch, build with CUDA for
# sm_90, run the CUDA tests and the GPU benchmark, and write the full results to $OUT (when set) with a short
# summary printed last. Must finish in under 8 minutes on the H200 machine (16 cores).
#
# That machine has no GoogleTest and reaches no registry: prepare a copy of Debian's sources here first,
#   scripts/gpu-check.sh --prepare        (copies /usr/src/googletest to third_party/googletest, git-ignored)
# then run this script there with third_party/googletest carried along.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ "${1:-}" == "--prepare" ]]; then
  mkdir -p "$root/third_party" && rm -rf "$root/third_party/googletest" &&
    cp -r /usr/src/googletest "$root/third_party/googletest" && echo "third_party/googletest ready"
  exit
fi
out="${OUT:-$root/build-gpu/out}"
mkdir -p "$out"
build="$root/build-gpu"
summary="$out/summary.txt"
: >"$summary"
note() { echo "$*" | tee -a "$summary"; }
start=$(date +%s)

python="$(command -v python3 || command -v python)"
prefix="$("$python" -c 'import torch; print(torch.utils.cmake_prefix_path)')"
note "torch: $("$python" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >>"$summary" 2>&1
# The host's processor, which steps the offloaded state (the kernel tests below name the level it runs).
note "cpu: $(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1), $(nproc) threads"
generator=(); command -v ninja >/dev/null && generator=(-G Ninja)
# (no precompiled LibTorch header: with 16 cores, waiting for it before any unit starts may cost what it saves;
# not measured there, and this run keeps the build it was written for)
if ! cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" \
     -DMEMSAVE_PRECOMPILE_HEADERS=OFF \
     -DMEMSAVE_WITH_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DTORCH_CUDA_ARCH_LIST=9.0 \
     -DMEMSAVE_GTEST_SOURCE_DIR="$root/third_party/googletest" >"$out/configure.log" 2>&1; then
  tail -30 "$out/configure.log"; note "FAILED: configure (see configure.log)"; exit 1
fi
if ! cmake --build "$build" --parallel "$(nproc)" --target memsave_tests memsave_cuda_tests memsave_kernel_tests \
     memsave_bench_optim_cuda memsave_bench_offload >"$out/build.log" 2>&1; then
  grep -E "error" "$out/build.log" | head -30; note "FAILED: build (see build.log)"; exit 1
fi
note "build: $(( $(date +%s) - start )) s"

status=0
run_tests() {  # binary, filter
  local name; name=$(basename "$1")
  if "$build/$1" --gtest_filter="$2" --gtest_output="xml:$out/$name.xml" >"$out/$name.log" 2>&1; then
    note "tests $name ($2): $(grep -E '^\[  (PASSED|SKIPPED) +\] [0-9]+ tests?' "$out/$name.log" | tr '\n' ' ')"
  else
    status=1; note "tests $name ($2): FAILED"; grep -E "Failure|FAILED|Expected|Which is" "$out/$name.log" | head -20 | tee -a "$summary"
  fi
}
run_tests tests/memsave_cuda_tests '*'
run_tests tests/memsave_tests 'Cuda*:EightBit*:Fp32State*:Meter*:Checkpoint*:Offload*:GradScaler*'
# (not the CUDA emulation: the tests above run the real thing, and CI runs the emulation)
run_tests tests/kernels/memsave_kernel_tests '*-*EmulatedCuda*:Simt*'
note "$(grep -m1 'CPU kernels ran with' "$out/memsave_kernel_tests.log")"

timeout 120 "$build/bench/memsave_bench_optim_cuda" 1000000000 >"$out/bench_optim_cuda.txt" 2>&1 || status=1
note "benchmark (bench/bench_optim_cuda.cpp, 10^9 parameters):"
cat "$out/bench_optim_cuda.txt" | tee -a "$summary"
# The offloaded gpt-1b step against the on-device one at two batch sizes (the host step costs the same at both;
# the device's forward and backward grow with the batch). Each run is time-limited so that the script ends
# within its 8 minutes; the benchmark prints each row as soon as it is measured.
for batch in 4 16; do
  left=$(( 450 - ($(date +%s) - start) ))
  if (( left < 60 )); then note "benchmark (bench/bench_offload.cpp, gpt-1b, batch $batch): skipped, ${left} s left"; continue; fi
  limit=$(( left < 200 ? left : 200 ))
  timeout "$limit" "$build/bench/memsave_bench_offload" --device cuda --model gpt-1b --batch "$batch" --steps 3 \
    >"$out/bench_offload_batch$batch.txt" 2>&1
  rc=$?
  note "benchmark (bench/bench_offload.cpp, gpt-1b on CUDA, batch $batch): exit status $rc (limit $limit s)"
  (( rc == 0 )) || status=1
  cat "$out/bench_offload_batch$batch.txt" | tee -a "$summary"
done
note "total: $(( $(date +%s) - start )) s, status $status"
exit $status

#!/usr/bin/env bash
# Builds llama-cpp-python for AVX2 + FMA only (no AVX-512, no AVX-VNNI), for comparing specee's AVX2
# tier with llama.cpp's AVX2 code on a machine that has AVX-512 (benchmark only: specee's users and
# CI never need it). The build goes to its own folder, beside any llama-cpp-python already installed;
# put it first on PYTHONPATH to benchmark against it:
#
#   bash scripts/build_llama_cpp_avx2.sh     # installs into $SPECEE_CACHE/llama-cpp-avx2
#   SPECEE_CPU_TIER=avx2 PYTHONPATH=$HOME/.cache/specee/llama-cpp-avx2 specee bench --modes dense,prompt-lookup,llama.cpp
#
# On a CPU without AVX-512 (a Zen 3, most Intel consumer chips) pip's own build of
# llama-cpp-python is already an AVX2 build (GGML_NATIVE). Environment: SPECEE_CACHE (default
# ~/.cache/specee), LLAMA_CPP_PYTHON_VERSION, BUILD_JOBS (default 2).
set -euo pipefail

version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
cache="${SPECEE_CACHE:-$HOME/.cache/specee}"
target="$cache/llama-cpp-avx2"
stamp="$target/build-info"  # the version and flags the installed build was made with
cmake_args="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF"
cmake_args+=" -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF"
cmake_args+=" -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DLLAMA_CURL=OFF"
build_info="llama-cpp-python $version $cmake_args"

if [[ -f "$stamp" && "$(cat "$stamp")" == "$build_info" ]]; then
    echo "llama-cpp-python $version (AVX2 only) is already built: $target"
    exit 0
fi
if ! command -v c++ >/dev/null && ! command -v g++ >/dev/null && ! command -v clang++ >/dev/null; then
    echo "error: no C++ compiler found (on Debian: apt-get install build-essential)" >&2
    exit 1
fi

rm -rf "$target"
CMAKE_ARGS="$cmake_args" CMAKE_BUILD_PARALLEL_LEVEL="${BUILD_JOBS:-2}" \
    python -m pip install --no-binary llama-cpp-python --no-deps --no-cache-dir --target "$target" \
    "llama-cpp-python==$version"
echo "$build_info" > "$stamp"
PYTHONPATH="$target" python -c "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"
echo "installed $target"

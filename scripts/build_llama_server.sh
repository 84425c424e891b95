#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` for `specee bench-serve` (benchmark only: specee's users
# and CI never need it). The llama.cpp source is the copy vendored in llama-cpp-python's
# source distribution on PyPI, pinned so that every run benchmarks the same llama.cpp.
#
#   bash scripts/build_llama_server.sh        # installs $SPECEE_CACHE/llama-server/bin/llama-server
#
# Environment: SPECEE_CACHE (default ~/.cache/specee), LLAMA_CPP_PYTHON_VERSION, BUILD_JOBS (default 2).
set -euo pipefail

version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
cache="${SPECEE_CACHE:-$HOME/.cache/specee}"
prefix="$cache/llama-server"
binary="$prefix/bin/llama-server"
stamp="$prefix/build-info"  # the version and flags the installed binary was built with
jobs="${BUILD_JOBS:-2}"
# CPU only, for this machine's instruction set less AMX: on the project's machines the kernel grants
# AMX but its first tile instruction faults (llama-server died at startup), and specee's own kernels
# use AVX-512 VNNI, not AMX. GCC keeps an explicit -mno-* over -march=native.
no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
cmake_flags=(
    -DCMAKE_BUILD_TYPE=Release
    -DBUILD_SHARED_LIBS=OFF
    -DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF
    "-DCMAKE_C_FLAGS=$no_amx" "-DCMAKE_CXX_FLAGS=$no_amx"
    -DLLAMA_CURL=OFF -DLLAMA_USE_PREBUILT_UI=OFF  # no network: no model downloads, no web UI download
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF
)
build_info="llama-cpp-python $version ${cmake_flags[*]}"

if [[ -x "$binary" && -f "$stamp" && "$(cat "$stamp")" == "$build_info" ]]; then
    echo "llama-server from llama-cpp-python $version is already built: $binary"
    exit 0
fi

if ! command -v c++ >/dev/null && ! command -v g++ >/dev/null && ! command -v clang++ >/dev/null; then
    echo "error: no C++ compiler found (on Debian: apt-get install build-essential)" >&2
    exit 1
fi
if ! command -v cmake >/dev/null; then
    echo "cmake not found: installing it with pip"
    python -m pip install cmake
fi

work="$prefix/build-$version"
rm -rf "$work"
mkdir -p "$work"
python -m pip download --no-binary :all: --no-deps --dest "$work" "llama-cpp-python==$version"
tar -xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
source_dir="$(echo "$work"/llama_cpp_python-*/vendor/llama.cpp)"

cmake -S "$source_dir" -B "$work/build" "${cmake_flags[@]}"
cmake --build "$work/build" --config Release --target llama-server -j "$jobs"

mkdir -p "$prefix/bin"
install -m 755 "$work/build/bin/llama-server" "$binary"
echo "$build_info" > "$stamp"
rm -rf "$work"
"$binary" --version
echo "installed $binary"

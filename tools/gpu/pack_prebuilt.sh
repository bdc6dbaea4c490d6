#!/usr/bin/env bash
# Packs what tools/gpu/run_gpu_checks.sh runs into .gpu-prebuilt/ (git-ignored), for a GPU
# machine whose image lacks the project's C++ dependencies (the H200 image has nvcc, CMake,
# ninja, PyTorch and transformers, but no Boost, yaml-cpp, spdlog or fmt).
#
#   tools/gpu/pack_prebuilt.sh [BUILD_DIR]     (default: build)
#
# Builds the CUDA test, the benchmark and the plugins they load in BUILD_DIR (which must be
# configured with a CUDA toolkit; sm_90 is the default architecture), then copies them with
# their non-system shared libraries (Boost.Filesystem, yaml-cpp, spdlog, fmt, libcudart),
# stripped of debug info. cuBLAS (hundreds of MB) is taken from the GPU machine's CUDA 13.
# Then: device run(command="bash tools/gpu/run_gpu_checks.sh", carry=[".gpu-prebuilt"]).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
BUILD=${1:-build}
OUT=$ROOT/.gpu-prebuilt
TARGETS=(cuda_kernels cuda_host bench_cuda backend-cuda attention-cuda-flash attention-flash quantizer-gguf
         scheduler-continuous kv_cache-paged sampler-standard)
cmake --build "$BUILD" -j "${JOBS:-2}" --target "${TARGETS[@]}"
rm -rf "$OUT"
mkdir -p "$OUT/bin" "$OUT/lib" "$OUT/plugins"
cp "$BUILD/tests/cuda/cuda_kernels" "$BUILD/tests/cuda/cuda_host" "$BUILD/bench/bench_cuda" "$OUT/bin/"
cp "$BUILD/lib/libtessera_core.so" "$OUT/lib/"
for p in backend-cuda attention-cuda-flash attention-flash quantizer-gguf scheduler-continuous kv_cache-paged \
         sampler-standard; do
  cp "$BUILD/plugins/libtessera-$p.so" "$OUT/plugins/"
done
# Non-system dependencies of everything above (not libc, libstdc++, libgcc, libm, the loader,
# nor cuBLAS and the driver).
for f in "$OUT"/bin/* "$OUT"/lib/*.so "$OUT"/plugins/*.so; do
  ldd "$f" | awk '/=> \// {print $3}'
done | sort -u | while read -r lib; do
  case "$(basename "$lib")" in
    libc.so*|libm.so*|libstdc++*|libgcc_s*|libdl.so*|libpthread*|librt.so*|ld-linux*|libcuda.so*|libcublas*|libtessera*) ;;
    *) cp -L "$lib" "$OUT/lib/" ;;
  esac
done
find "$OUT" -type f \( -name '*.so*' -o -path '*/bin/*' \) -exec strip --strip-debug {} +
git -C "$ROOT" rev-parse HEAD > "$OUT/COMMIT"
du -sh "$OUT"
ls -la "$OUT"/*

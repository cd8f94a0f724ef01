# CMake toolchain file: cross-compile megamoe for aarch64 (arm64/SBSA) Linux on x86_64.
#
# ci/build_wheels.py sets the environment this file reads:
#   MEGAMOE_CROSS_CUDA  a CUDA tree whose bin/ and nvvm/ are the x86_64 nvcc and whose
#                       targets/sbsa-linux holds the aarch64 runtime (headers + libs
#                       from the nvidia-cuda-runtime manylinux aarch64 wheel)
#   MEGAMOE_CROSS_ROOT  the aarch64 Debian root (debootstrap --arch=arm64): Python
#                       headers for the module, and the root the wheel is smoke-tested in
# Device code is unchanged: nvcc emits the same sm_90a cubin whatever the host arch.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)

set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
set(CMAKE_CUDA_HOST_COMPILER aarch64-linux-gnu-g++)
set(CMAKE_CUDA_COMPILER "$ENV{MEGAMOE_CROSS_CUDA}/bin/nvcc")
set(CUDAToolkit_ROOT "$ENV{MEGAMOE_CROSS_CUDA}")

# Libraries and headers come from the aarch64 CUDA target dir and the cross toolchain's
# own sysroot; programs (python, nvcc, ninja) are the build machine's.
set(CMAKE_FIND_ROOT_PATH "$ENV{MEGAMOE_CROSS_CUDA}/targets/sbsa-linux")
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE BOTH)

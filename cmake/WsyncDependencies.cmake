# Finds every dependency through its package config or CMake module (all from Debian 12's packages;
# tools/setup.sh installs them). CUDA and NCCL are optional and detected here, once.

find_package(Threads REQUIRED)
find_package(MPI REQUIRED COMPONENTS CXX)
find_package(Protobuf REQUIRED)
find_package(gRPC CONFIG REQUIRED)
find_package(absl CONFIG REQUIRED)
find_package(GTest REQUIRED)
find_package(Gloo CONFIG REQUIRED)
find_package(hwy CONFIG REQUIRED)
find_package(nlohmann_json CONFIG REQUIRED)
find_package(CLI11 CONFIG REQUIRED)
find_package(OpenSSL REQUIRED COMPONENTS Crypto)
find_package(PkgConfig REQUIRED)
pkg_check_modules(HTTPLIB REQUIRED IMPORTED_TARGET cpp-httplib)
pkg_check_modules(XXHASH REQUIRED IMPORTED_TARGET libxxhash)

# --- CUDA toolkit + NCCL (optional) ---------------------------------------------------------------
set(WSYNC_HAVE_CUDA OFF)
set(WSYNC_HAVE_NCCL OFF)
if(NOT WSYNC_WITH_CUDA STREQUAL "OFF")
  if(NOT CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX} AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES "80;90")
    endif()
    enable_language(CUDA)
    # Every binary that links the kernels carries their fatbin (SASS for sm_80 / sm_90 and PTX for
    # both): compressed, about 4.5x smaller (int4_kernels.cu: 2.2 -> 0.48 MB), inflated by the CUDA
    # runtime when the module loads. It keeps the device bundle's folder small (docs/gpu.md).
    string(APPEND CMAKE_CUDA_FLAGS " -Xfatbin=-compress-all")
    # CMake 3.25 predates nvcc's C++20 support: teach it the flag, then ask for C++20 like the host code.
    set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
    set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
    set(CMAKE_CUDA_STANDARD 20)
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    # Debian 12's FindCUDAToolkit (CMake 3.25.1) sets DEPRECATION on CUDA::nvToolsExt without checking that it exists
    # when the project requires CMake >= 3.25, and CUDA 13 has no libnvToolsExt; wsync uses no NVTX, so the module
    # runs with the minimum version read as 3.24, which only skips that tag (policies are not affected).
    set(_wsync_cmake_minimum "${CMAKE_MINIMUM_REQUIRED_VERSION}")
    set(CMAKE_MINIMUM_REQUIRED_VERSION 3.24)
    find_package(CUDAToolkit REQUIRED)
    set(CMAKE_MINIMUM_REQUIRED_VERSION "${_wsync_cmake_minimum}")
    unset(_wsync_cmake_minimum)
    set(WSYNC_HAVE_CUDA ON)
    find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} /usr/local/cuda/include)
    find_library(NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR} /usr/local/cuda/lib /usr/local/cuda/lib64)
    if(NCCL_INCLUDE_DIR AND NCCL_LIBRARY)
      add_library(wsync_nccl INTERFACE)
      target_include_directories(wsync_nccl INTERFACE ${NCCL_INCLUDE_DIR})
      target_link_libraries(wsync_nccl INTERFACE ${NCCL_LIBRARY} CUDA::cudart)
      set(WSYNC_HAVE_NCCL ON)
    elseif(WSYNC_WITH_CUDA STREQUAL "ON")
      message(FATAL_ERROR "WSYNC_WITH_CUDA=ON but NCCL (nccl.h, libnccl) was not found")
    endif()
  elseif(WSYNC_WITH_CUDA STREQUAL "ON")
    message(FATAL_ERROR "WSYNC_WITH_CUDA=ON but no CUDA compiler (nvcc) was found")
  endif()
endif()

# --- libFuzzer (clang only) -----------------------------------------------------------------------
set(WSYNC_HAVE_FUZZ OFF)
if(CMAKE_CXX_COMPILER_ID MATCHES "Clang" AND NOT WSYNC_FUZZ STREQUAL "OFF")
  set(WSYNC_HAVE_FUZZ ON)
elseif(WSYNC_FUZZ STREQUAL "ON")
  message(FATAL_ERROR "WSYNC_FUZZ=ON needs clang (libFuzzer); configure with CXX=clang++")
endif()

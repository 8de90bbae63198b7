// WSYNC_HD: the annotation of the bit-level helpers in format/ that both the CPU kernels and the
// CUDA kernels call (host and device functions under nvcc, plain inline functions elsewhere).
#pragma once

#ifdef __CUDACC__
#define WSYNC_HD __host__ __device__ __forceinline__
#else
#define WSYNC_HD inline
#endif

// Marks functions that both the CPU and the CUDA backend call, so one numeric rule is written once.
#pragma once

#if defined(__CUDACC__)
#define MEMSAVE_HD __host__ __device__ __forceinline__
#else
#define MEMSAVE_HD inline
#endif

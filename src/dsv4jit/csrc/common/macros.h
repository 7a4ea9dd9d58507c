// Function qualifiers that also compile in host-only translation units (no CUDA headers).
#pragma once

#if defined(__CUDACC__)
#define DSV4_HD __host__ __device__ __forceinline__
#define DSV4_DEV __device__ __forceinline__
#else
#define DSV4_HD inline
#endif

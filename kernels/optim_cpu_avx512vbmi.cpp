// The CPU kernels built for avx512 with VBMI (byte permutes; see optim_cpu_impl.h).
#define MEMSAVE_CPU_ISA avx512vbmi
#include "optim_cpu_impl.h"

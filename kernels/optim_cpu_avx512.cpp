// The CPU kernels built for avx512 (see optim_cpu_impl.h).
#define MEMSAVE_CPU_ISA avx512
#include "optim_cpu_impl.h"

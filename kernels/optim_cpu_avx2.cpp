// The CPU kernels built for avx2 (see optim_cpu_impl.h).
#define MEMSAVE_CPU_ISA avx2
#include "optim_cpu_impl.h"

// The CPU kernels built for baseline (see optim_cpu_impl.h).
#define MEMSAVE_CPU_ISA baseline
#include "optim_cpu_impl.h"

// memsave: fit LibTorch training in less memory. The umbrella header.
#pragma once

#include <memsave/memory.h>
#include <memsave/optim.h>

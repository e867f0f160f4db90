// memsave: fit LibTorch training in less memory. The umbrella header.
#pragma once

#include <memsave/amp.h>
#include <memsave/checkpoint.h>
#include <memsave/memory.h>
#include <memsave/optim.h>

// memsave: fit LibTorch training in less memory. The umbrella header.
#pragma once

#include <memsave/accumulate.h>
#include <memsave/amp.h>
#include <memsave/checkpoint.h>
#include <memsave/memory.h>
#include <memsave/offload.h>
#include <memsave/optim.h>
#include <memsave/rescue.h>
#include <memsave/trainer.h>

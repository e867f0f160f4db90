// Writes the optimizer state of each run of scenario.h after kSteps steps, and each Trainer's file after as
// many, to DIR/<name>.pt:
//
//   write_archives DIR
//
// tests/data/archives/SOURCE.md says which build wrote the checked-in files.
#include "scenario.h"

#include <memsave/memory.h>

#include <torch/serialize.h>

#include <iostream>

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: write_archives DIR\n";
    return 2;
  }
  memsave::install_meter();
  for (const auto& c : memsave::archives::cases()) {
    const auto params = memsave::archives::parameters();
    auto opt = c.make(params);
    memsave::archives::train(*opt, params, 1, memsave::archives::kSteps);
    const std::string path = std::string(argv[1]) + "/" + c.name + ".pt";
    torch::serialize::OutputArchive archive;
    opt->save(archive);
    archive.save_to(path);
    std::cout << path << "\n";
  }
  for (const auto& c : memsave::archives::trainer_cases()) {
    memsave::Trainer trainer(memsave::archives::trainer_model(), memsave::adamw(1e-2), c.recipe);
    memsave::archives::train(trainer, 1, memsave::archives::kSteps);
    const std::string path = std::string(argv[1]) + "/" + c.name + ".pt";
    trainer.save(path);
    std::cout << path << "\n";
  }
  return 0;
}

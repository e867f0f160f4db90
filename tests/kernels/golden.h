// Reads tests/data/golden.txt, written by scripts/golden/make_golden.py: "name v1 v2 ..." with hex floats.
#pragma once

#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace memsave::testing {

inline const std::vector<float>& golden(const std::string& name) {
  static const std::map<std::string, std::vector<float>> records = [] {
    std::map<std::string, std::vector<float>> out;
    std::ifstream in(MEMSAVE_GOLDEN);
    if (!in) throw std::runtime_error("cannot read " MEMSAVE_GOLDEN);
    std::string line;
    while (std::getline(in, line)) {
      if (line.empty() || line[0] == '#') continue;
      std::istringstream fields(line);
      std::string key, value;
      fields >> key;
      std::vector<float>& values = out[key];
      while (fields >> value) values.push_back(static_cast<float>(std::strtod(value.c_str(), nullptr)));
    }
    return out;
  }();
  const auto it = records.find(name);
  if (it == records.end()) throw std::runtime_error("no golden record " + name);
  return it->second;
}

}  // namespace memsave::testing

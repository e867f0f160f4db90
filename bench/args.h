// The benchmark programs' command lines: `--name value` pairs, each read once; a flag no program reads, a
// missing value or a number out of range ends the program with a message instead of being ignored.
//   memsave::bench::Args args(argc, argv);
//   const int steps = args.integer("--steps", 3, /*min=*/1);
//   args.finish();  // after the last read: rejects what was not read
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace memsave::bench {

class Args {
 public:
  Args(int argc, char** argv) : program_(argv[0]) {
    for (int i = 1; i < argc; ++i) words_.emplace_back(argv[i]);
    used_.assign(words_.size(), false);
  }

  /// The value after `flag`, or `fallback` when the flag is absent.
  std::string text(const std::string& flag, std::string fallback) {
    for (size_t i = 0; i < words_.size(); ++i) {
      if (words_[i] != flag) continue;
      if (i + 1 == words_.size()) fail(flag + " needs a value");
      used_[i] = used_[i + 1] = true;
      return words_[i + 1];
    }
    return fallback;
  }

  /// The integer after `flag` (at least `min`), or `fallback` when the flag is absent.
  long long integer(const std::string& flag, long long fallback, long long min) {
    const std::string value = text(flag, std::to_string(fallback));
    char* end = nullptr;
    const long long parsed = std::strtoll(value.c_str(), &end, 10);
    if (value.empty() || *end != '\0' || parsed < min)
      fail(flag + " " + value + ": expected an integer of at least " + std::to_string(min));
    return parsed;
  }

  /// Ends the program if a word was not read as a flag or its value.
  void finish() const {
    for (size_t i = 0; i < words_.size(); ++i)
      if (!used_[i]) fail("unknown argument '" + words_[i] + "'");
  }

 private:
  [[noreturn]] void fail(const std::string& why) const {
    std::fprintf(stderr, "%s: %s\n", program_.c_str(), why.c_str());
    std::exit(2);
  }

  std::string program_;
  std::vector<std::string> words_;
  std::vector<bool> used_;
};

}  // namespace memsave::bench

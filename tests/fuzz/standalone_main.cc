// A main() for fuzz targets where libFuzzer is not available (g++ builds).
//
// Runs LLVMFuzzerTestOneInput on every seed file named on the command line,
// then for --runs=N iterations on mutations of them: random byte flips,
// insertions, truncations, and 64-bit words replaced by values next to the
// bounds that matter (0, 2^32, 2^63, 2^64 - 1, and small offsets from them).
// Deterministic for a given --seed. No coverage feedback: weaker than
// libFuzzer, but it runs everywhere, with the sanitizers, in `make test`.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

int main(int argc, char** argv) {
  long runs = 100000;
  unsigned seed = 1;
  std::vector<std::string> seeds;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--runs=", 7) == 0) {
      runs = std::atol(argv[i] + 7);
    } else if (std::strncmp(argv[i], "--seed=", 7) == 0) {
      seed = static_cast<unsigned>(std::atol(argv[i] + 7));
    } else {
      std::ifstream in(argv[i], std::ios::binary);
      seeds.emplace_back(std::istreambuf_iterator<char>(in),
                         std::istreambuf_iterator<char>());
    }
  }
  if (seeds.empty()) seeds.push_back(std::string(1, '\0'));
  for (const std::string& s : seeds) {
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(s.data()), s.size());
  }
  std::mt19937_64 rng(seed);
  const uint64_t kEdges[] = {0,
                             1,
                             8,
                             64,
                             4096,
                             uint64_t(1) << 32,
                             uint64_t(1) << 58,
                             uint64_t(1) << 63,
                             ~uint64_t(0)};
  for (long r = 0; r < runs; ++r) {
    std::string s = seeds[rng() % seeds.size()];
    int edits = 1 + static_cast<int>(rng() % 8);
    for (int e = 0; e < edits; ++e) {
      switch (rng() % 5) {
        case 0:  // flip a byte
          if (!s.empty()) s[rng() % s.size()] ^= static_cast<char>(1 << (rng() % 8));
          break;
        case 1:  // insert a byte
          s.insert(s.begin() + (s.empty() ? 0 : rng() % (s.size() + 1)),
                   static_cast<char>(rng()));
          break;
        case 2:  // truncate
          if (!s.empty()) s.resize(rng() % s.size());
          break;
        case 3: {  // a word next to a bound, at an 8-byte position after the selector
          uint64_t v = kEdges[rng() % (sizeof(kEdges) / sizeof(kEdges[0]))];
          v += static_cast<uint64_t>(static_cast<int64_t>(rng() % 17) - 8);
          size_t at = 1 + 8 * (rng() % 8);
          if (s.size() < at + 8) s.resize(at + 8, '\0');
          std::memcpy(&s[at], &v, 8);
          break;
        }
        case 4: {  // a decimal number, some of them 20 digits and more
          std::string digits = std::to_string(rng());
          if (rng() % 2) digits += std::to_string(rng() % 1000);
          s.insert(s.size() > 1 ? 1 + rng() % (s.size() - 1) : s.size(), digits);
          break;
        }
      }
    }
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(s.data()), s.size());
  }
  std::printf("standalone fuzz: %zu seeds, %ld mutated inputs, no failure\n",
              seeds.size(), runs);
  return 0;
}

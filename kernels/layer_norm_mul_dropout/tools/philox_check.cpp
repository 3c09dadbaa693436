// Host build of philox.h (the very code the kernels run) for the CPU test: prints the raw
// Philox4x32-10 words of counter 0 / key 0 and of counter all-ones / key all-ones (published
// known-answer vectors), then, for `seed offset threshold chunks` on the command line, the keep
// bits of chunks 0..chunks-1, one per line.
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>

#include "../philox.h"

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s SEED OFFSET THRESHOLD CHUNKS\n", argv[0]);
    return 2;
  }
  const uint64_t seed = std::strtoull(argv[1], nullptr, 10);
  const uint64_t offset = std::strtoull(argv[2], nullptr, 10);
  const uint32_t threshold = static_cast<uint32_t>(std::strtoul(argv[3], nullptr, 10));
  const uint64_t chunks = std::strtoull(argv[4], nullptr, 10);
  const uint64_t ones = ~uint64_t(0);
  for (const lnmd::Philox4 kat : {lnmd::philox4x32_10(0, 0, 0), lnmd::philox4x32_10(ones, ones, ones)}) {
    std::printf("%08x %08x %08x %08x\n", kat.v[0], kat.v[1], kat.v[2], kat.v[3]);
  }
  for (uint64_t c = 0; c < chunks; ++c) {
    std::printf("%u\n", lnmd::keep_bits(c, seed, offset, threshold));
  }
  return 0;
}

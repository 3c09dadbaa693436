// Host build of philox.h (the very code the kernels run) for the CPU test: prints the raw
// Philox4x32-10 words of counter 0 / key 0 (a published known-answer vector) and then, for
// `seed threshold chunks` on the command line, the keep bits of chunks 0..chunks-1, one per line.
#include <cinttypes>
#include <cstdio>
#include <cstdlib>

#include "../philox.h"

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s SEED THRESHOLD CHUNKS\n", argv[0]);
    return 2;
  }
  const uint64_t seed = std::strtoull(argv[1], nullptr, 10);
  const uint32_t threshold = static_cast<uint32_t>(std::strtoul(argv[2], nullptr, 10));
  const uint64_t chunks = std::strtoull(argv[3], nullptr, 10);
  const lnmd::Philox4 kat = lnmd::philox4x32_10(0, 0);
  std::printf("%08x %08x %08x %08x\n", kat.v[0], kat.v[1], kat.v[2], kat.v[3]);
  for (uint64_t c = 0; c < chunks; ++c) {
    std::printf("%u\n", lnmd::keep_bits(c, seed, threshold));
  }
  return 0;
}

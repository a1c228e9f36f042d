// AMX tile plumbing shared by the kernels that use tiles (quant_tiles.h,
// prefill_attention.cpp): the tile configuration record and the process's permission.
#pragma once

#include <cstdint>

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#define FOLIO_AMX 1

namespace folio {

// ldtilecfg's 64-byte record: palette 1, then per tile register its bytes per row and
// its rows. The shapes are per thread: a kernel loads its own before its first tile op
// of a call (torch's own AMX GEMMs load theirs).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};

  void shape(int tile, int num_rows, int bytes_per_row) {
    rows[tile] = static_cast<uint8_t>(num_rows);
    colsb[tile] = static_cast<uint16_t>(bytes_per_row);
  }
};

// Loads the configuration with all eight tiles at their full shape, 16 rows of 64 bytes
// (the kernels that use no smaller tile: prefill_attention.cpp, amx_linear.cpp).
inline void configure_full_tiles() {
  static const TileConfig config = [] {
    TileConfig c;
    for (int t = 0; t < 8; ++t) c.shape(t, 16, 64);
    return c;
  }();
  _tile_loadconfig(&config);
}

// Linux hands a process the AMX tile state only on request (arch_prctl
// ARCH_REQ_XCOMP_PERM for XTILEDATA); without it the first tile op is SIGILL. Asked
// once per process; false where the kernel refuses.
inline bool amx_permitted() {
  static const bool granted = [] {
#if defined(__linux__) && defined(SYS_arch_prctl)
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
#else
    return false;
#endif
  }();
  return granted;
}

}  // namespace folio
#endif

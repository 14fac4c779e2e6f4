// What the chunk selection's host planner (chunk_selection.cu) decides and its kernels read: the modes, the tile
// geometry of the landmark logits, the layout of the select kernel's shared memory, and the shared-memory budget
// they are planned against. See chunk_selection.cu for how the kernels fit together.
#pragma once

#include <cuda_runtime.h>

#include "cuda_check.hpp"

namespace shadowkv::cuda::selection {

constexpr int kLogitThreads = 256;  // 2 threads a row at 128 rows: 24 warps per SM hide the LDS/FMA latency
constexpr int kDefaultSharedLimit = 48 * 1024;
/// Left for the select kernel's static shared memory (kSelectStaticShared in select_kernel.cu: ~17 KiB, most of it
/// the radix histogram) when its dynamic part is planned against the device's opt-in limit and the 48 KiB default.
constexpr int kSharedMargin = 20 * 1024;

/// What the host plans against, per device (chunk_selection.cu asks once per device ordinal).
struct device_limits {
  int optin_shared;  ///< bytes of shared memory a block may opt in to
  int multiprocessors;
};

/// Tiles of the landmark logits kernel (landmark_scoring.cu); the score merge and the select kernel read the softmax
/// partials it leaves per tile.
struct logit_geometry {
  int tile_rows;   ///< chunks per tile (power of two, 8..128)
  int parts;       ///< threads sharing one row: kLogitThreads / tile_rows (they split the 16-byte vectors)
  int row_stride;  ///< bytes per staged row: vectors * 16 + 16 (the extra 16 B keep row reads free of conflicts)
  int vectors;     ///< 16-byte vectors per row, rounded up (a row's tail past D is zero-filled)
  int tiles;       ///< ceil(max_chunks / tile_rows)
  int write_partials;
};

/// Where the select kernel gets p_j(c) from. int-sized: it travels in a kernel argument.
enum class select_mode : int {
  from_scores,  ///< the score merge left score(c) in logits row 0 (-1 for non-candidates)
  from_logits,  ///< logits rows, no partials (they did not fit): normalisers computed in the select kernel
  in_kernel,    ///< several tokens, partials do not fit: everything computed in the select kernel (slow, rare)
};

struct select_geometry {
  select_mode mode;
  int radix_keys_in_shared;  ///< 1: per-chunk radix keys in dynamic shared memory at radix_keys_offset; 0: in the
                             ///< group's first logits row
  int radix_keys_offset;     ///< bytes
  int q_floats;              ///< shared floats reserved for one query row (several-token path only)
  int tile_rows;             ///< the logits kernel's tile, for the partials
  int tiles;                 ///< the logits kernel's tiles over max_chunks
};

template <typename Kernel>
void allow_shared(Kernel kernel, long long bytes) {
  // A host-side attribute, legal while a stream is being captured; needed when the dynamic bytes and the kernel's
  // static shared memory (at most kSharedMargin) together pass the 48 KiB default. (Testing the dynamic bytes alone
  // let the select kernel launch with 33 KiB dynamic + 17 KiB static at 65536-token contexts: cudaErrorInvalidValue.)
  if (bytes + kSharedMargin > kDefaultSharedLimit) {
    SHADOWKV_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  }
}

}  // namespace shadowkv::cuda::selection

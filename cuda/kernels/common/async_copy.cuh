// Asynchronous global -> shared copies (cp.async, sm_80 and later): the one way the kernels issue, commit and wait for
// them. The bytes in flight cost no registers, so a kernel can keep several stages of rows coming while it computes.
#pragma once

#include <cuda_runtime.h>

namespace shadowkv::cuda {

/// Where a cp.async copy is cached on its way to shared memory.
enum class copy_cache : int {
  l2_only,     ///< .cg: bypasses L1 (rows read once); 16-byte copies only
  all_levels,  ///< .ca: L1 and L2; 4, 8 or 16 bytes
};

/// Copies kBytes from `global` to `shared` asynchronously. kPrefetch128: also hints L2 to fetch the whole 128-byte
/// line (.L2::128B), for gathers whose neighbouring bytes are copied next.
template <int kBytes, copy_cache kCache = copy_cache::l2_only, bool kPrefetch128 = false>
__device__ __forceinline__ void copy_async(void* shared, const void* global) {
  static_assert(kBytes == 4 || kBytes == 8 || kBytes == 16, "cp.async copies 4, 8 or 16 bytes");
  static_assert(kCache == copy_cache::all_levels || kBytes == 16, "cp.async.cg copies 16 bytes only");
  const auto destination = static_cast<unsigned>(__cvta_generic_to_shared(shared));
  if constexpr (kCache == copy_cache::l2_only && !kPrefetch128) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(destination), "l"(global) : "memory");
  } else if constexpr (kCache == copy_cache::l2_only) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;\n" ::"r"(destination), "l"(global) : "memory");
  } else if constexpr (!kPrefetch128) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(destination), "l"(global), "n"(kBytes)
                 : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global.L2::128B [%0], [%1], %2;\n" ::"r"(destination), "l"(global), "n"(kBytes)
                 : "memory");
  }
}

/// As copy_async, but writes zeros instead when !live (source size 0: `global` must still be a valid address).
template <int kBytes, copy_cache kCache = copy_cache::l2_only, bool kPrefetch128 = false>
__device__ __forceinline__ void copy_async_or_zero(void* shared, const void* global, bool live) {
  static_assert(kBytes == 4 || kBytes == 8 || kBytes == 16, "cp.async copies 4, 8 or 16 bytes");
  static_assert(kCache == copy_cache::all_levels || kBytes == 16, "cp.async.cg copies 16 bytes only");
  const auto destination = static_cast<unsigned>(__cvta_generic_to_shared(shared));
  const int source_bytes = live ? kBytes : 0;
  if constexpr (kCache == copy_cache::l2_only && !kPrefetch128) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(destination), "l"(global),
                 "r"(source_bytes)
                 : "memory");
  } else if constexpr (kCache == copy_cache::l2_only) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(destination), "l"(global),
                 "r"(source_bytes)
                 : "memory");
  } else if constexpr (!kPrefetch128) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(destination), "l"(global), "n"(kBytes),
                 "r"(source_bytes)
                 : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global.L2::128B [%0], [%1], %2, %3;\n" ::"r"(destination), "l"(global),
                 "n"(kBytes), "r"(source_bytes)
                 : "memory");
  }
}

/// An L2 cache policy for bytes a kernel reads once (the landmarks, every one of them every step): evict-first, so
/// that streaming them does not push out of L2 what the step's next kernels read back (the logits the select scores,
/// the tables and the selection cache). For the .L2::cache_hint forms below.
__device__ __forceinline__ unsigned long long read_once_policy() {
  unsigned long long policy = 0;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

/// copy_async_or_zero<16> (.cg: L2 only) under an L2 cache policy (read_once_policy).
__device__ __forceinline__ void copy_async_or_zero_with_policy(void* shared, const void* global, bool live,
                                                               unsigned long long policy) {
  const auto destination = static_cast<unsigned>(__cvta_generic_to_shared(shared));
  const int source_bytes = live ? 16 : 0;
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(destination), "l"(global),
               "r"(source_bytes), "l"(policy)
               : "memory");
}

/// One bulk copy by the TMA (sm_90 on) of `bytes` (a multiple of 16; both addresses 16-byte aligned) into shared
/// memory, whose landing completes `bytes` of the transaction barrier `barrier` (cutlass::arch::ClusterTransactionBarrier),
/// under an L2 cache policy (read_once_policy). Traps on older devices, as cute's SM90_BULK_COPY_G2S does.
__device__ __forceinline__ void bulk_copy_with_policy(void* shared, const void* global, unsigned long long* barrier,
                                                      unsigned bytes, unsigned long long policy) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const auto destination = static_cast<unsigned>(__cvta_generic_to_shared(shared));
  const auto transactions = static_cast<unsigned>(__cvta_generic_to_shared(barrier));
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;\n" ::
          "r"(destination),
      "l"(global), "r"(bytes), "r"(transactions), "l"(policy)
      : "memory");
#else
  (void)shared, (void)global, (void)barrier, (void)bytes, (void)policy;
  __trap();
#endif
}

/// Closes this thread's copies issued since the last commit into one group (an empty group is allowed, and keeps the
/// wait count of a pipeline fixed).
__device__ __forceinline__ void commit_async_copies() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

/// Waits until at most kPending of this thread's committed copy groups are still in flight. Other threads' copies
/// need a barrier besides.
template <int kPending>
__device__ __forceinline__ void wait_async_copies() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

/// wait_async_copies<pending> for a count known at run time (0 to 3; more waits as for 3).
__device__ __forceinline__ void wait_async_copies_at_most(int pending) {
  switch (pending) {
    case 0: wait_async_copies<0>(); break;
    case 1: wait_async_copies<1>(); break;
    case 2: wait_async_copies<2>(); break;
    default: wait_async_copies<3>(); break;
  }
}

}  // namespace shadowkv::cuda

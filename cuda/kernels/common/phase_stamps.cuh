// Where one CTA of a kernel spends its time: clock64() stamps at the kernel's phase boundaries, by thread 0 of the
// CTA at blockIdx (0, 0, 0), printed (one launch in 16) when the CTA ends. A measuring tool, compiled in only with
// -DSHADOWKV_PHASE_STAMPS (bench/probes/phase_stamps.sh builds the module so and sums the printed lines); without it
// every call below is empty and the kernels are the ones that ship.
//
// A stamp placed right after a barrier is the block's progress; one placed before wait_for_prior_grids shows how long
// the CTA waited for the kernel before it. The line names the SM and the global timer's nanoseconds between the
// first and the last stamp, so the cycles can be read as time.
//
// CTA spans (the rebuild, logits, attention, value-fetch and combine kernels, whose every CTA ends in
// finish_phase_stamps): every CTA notes the global timer at its start and end; the CTA that ends last prints, for one
// launch in 16, when the grid's CTAs started and ended, as histograms of 1 µs bins from the first start, and that
// first start on the global timer ("cta_spans <kernel> ctas <n> starts bin:count ... ends bin:count ... first_ns
// <t>"), so that a kernel's time can be told apart into late starts and slow CTAs, and the kernels of one step laid
// side by side (phase_stamps.py pairs the printed launches by their first starts).
#pragma once

#include <cuda_runtime.h>

#ifdef SHADOWKV_PHASE_STAMPS
#include <cstdio>
#endif

namespace shadowkv::cuda {

enum class stamped_kernel : int { select = 0, rebuild = 1, logits = 2, attention = 3, fetch = 4, combine = 5 };
constexpr int kStampedKernels = 6;

#ifdef SHADOWKV_PHASE_STAMPS
constexpr int kMaxPhaseStamps = 64;
static __device__ long long phase_stamp_cycles[kStampedKernels][kMaxPhaseStamps];
static __device__ unsigned long long phase_stamp_times[kStampedKernels][2];
static __device__ int phase_stamp_labels[kStampedKernels][kMaxPhaseStamps];
static __device__ unsigned phase_stamp_launches[kStampedKernels];

constexpr int kMaxSpanCtas = 8192;
constexpr int kSpanBins = 64;  // of 1 µs
static __device__ unsigned long long cta_span_start[kStampedKernels][kMaxSpanCtas];
static __device__ unsigned long long cta_span_end[kStampedKernels][kMaxSpanCtas];
static __device__ unsigned cta_spans_done[kStampedKernels];
static __device__ unsigned cta_span_launches[kStampedKernels];

/// The stamping CTA's stamps so far, in shared memory: a stamp costs its thread a shared load and store, not a global
/// round trip (with several stamps a tile, the global count's loads slowed the phases they measured; docs/performance.md,
/// session 29). One variable a CTA for every call site of the kernel.
__device__ __forceinline__ int& phase_stamp_count() {
  __shared__ int count;
  return count;
}

__device__ __forceinline__ bool stamping_cta() {
  return threadIdx.x == 0 && threadIdx.y == 0 && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0;
}

__device__ __forceinline__ unsigned long long global_nanoseconds() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ bool spanned(stamped_kernel kernel) {
  return kernel != stamped_kernel::select && threadIdx.x == 0 && threadIdx.y == 0 &&
         gridDim.x * gridDim.y * gridDim.z <= kMaxSpanCtas;
}

__device__ __forceinline__ unsigned linear_cta() {
  return blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
}

/// Thread 0 of the CTA that ends last: the grid's start and end histograms (see above), then the count reset.
__device__ __forceinline__ void print_cta_spans(int k, unsigned ctas) {
  unsigned long long first = ~0ULL;
  for (unsigned c = 0; c < ctas; ++c) first = min(first, __ldcg(&cta_span_start[k][c]));  // (other SMs wrote them)
  unsigned starts[kSpanBins] = {};
  unsigned ends[kSpanBins] = {};
  for (unsigned c = 0; c < ctas; ++c) {
    starts[min(static_cast<unsigned long long>(kSpanBins - 1), (__ldcg(&cta_span_start[k][c]) - first) / 1000)] += 1;
    ends[min(static_cast<unsigned long long>(kSpanBins - 1), (__ldcg(&cta_span_end[k][c]) - first) / 1000)] += 1;
  }
  char line[1536];
  int at = 0;
  auto put_number = [&](unsigned x) {
    char digits[12];
    int n = 0;
    do {
      digits[n++] = static_cast<char>('0' + x % 10);
      x /= 10;
    } while (x > 0 && n < 12);
    while (n > 0 && at < 1500) line[at++] = digits[--n];
  };
  auto put_bins = [&](const char* name, const unsigned (&bins)[kSpanBins]) {
    for (const char* t = name; *t != '\0' && at < 1500; ++t) line[at++] = *t;
    for (int b = 0; b < kSpanBins; ++b) {
      if (bins[b] == 0) continue;
      if (at < 1500) line[at++] = ' ';
      put_number(static_cast<unsigned>(b));
      if (at < 1500) line[at++] = ':';
      put_number(bins[b]);
    }
  };
  put_bins(" starts", starts);
  put_bins(" ends", ends);
  line[at] = '\0';
  printf("cta_spans %d ctas %u%s first_ns %llu\n", k, ctas, line, first);
}

/// The first stamp of a launch (label 0).
__device__ __forceinline__ void start_phase_stamps(stamped_kernel kernel) {
  if (spanned(kernel)) cta_span_start[static_cast<int>(kernel)][linear_cta()] = global_nanoseconds();
  if (!stamping_cta()) return;
  const int k = static_cast<int>(kernel);
  phase_stamp_times[k][0] = global_nanoseconds();
  phase_stamp_cycles[k][0] = clock64();
  phase_stamp_labels[k][0] = 0;
  phase_stamp_count() = 1;
}

__device__ __forceinline__ void record_phase_stamp(int k, int i, int label) {
  phase_stamp_cycles[k][i] = clock64();
  phase_stamp_labels[k][i] = label;
  phase_stamp_count() = i + 1;
}

/// A stamp labelled `label` (a number the probe's table names; a phase inside a loop stamps once an iteration). The
/// last slot is kept for finish_phase_stamps, so that the printed cycles always end where the global-timer span
/// ends and phase_stamps.py's cycles-to-µs scale holds when a long loop runs out of slots.
__device__ __forceinline__ void phase_stamp(stamped_kernel kernel, int label) {
  if (!stamping_cta()) return;
  const int i = phase_stamp_count();
  if (i >= kMaxPhaseStamps - 1) return;
  record_phase_stamp(static_cast<int>(kernel), i, label);
}

/// The last stamp: prints "phase_stamps <kernel> sm <id> ns <first to last> : label:cycles ..." (cycles since the
/// first stamp) for one launch in 16.
__device__ __forceinline__ void finish_phase_stamps(stamped_kernel kernel, int label) {
  if (spanned(kernel)) {
    const int k = static_cast<int>(kernel);
    const unsigned ctas = gridDim.x * gridDim.y * gridDim.z;
    cta_span_end[k][linear_cta()] = global_nanoseconds();
    __threadfence();
    if (atomicAdd(&cta_spans_done[k], 1U) == ctas - 1) {  // the last CTA of the grid: every other span is written
      __threadfence();
      cta_spans_done[k] = 0;
      if (atomicAdd(&cta_span_launches[k], 1U) % 16 == 7) print_cta_spans(k, ctas);
    }
  }
  if (!stamping_cta()) return;
  const int k = static_cast<int>(kernel);
  record_phase_stamp(k, min(phase_stamp_count(), kMaxPhaseStamps - 1), label);
  phase_stamp_times[k][1] = global_nanoseconds();
  const unsigned launch = atomicAdd(&phase_stamp_launches[k], 1U);
  if (launch % 16 != 7) return;
  unsigned sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  char line[1024];
  int at = 0;
  auto put = [&](const char* text) {
    while (*text != '\0' && at < 1000) line[at++] = *text++;
  };
  auto put_number = [&](long long x) {
    char digits[24];
    int n = 0;
    if (x < 0) {
      put("-");
      x = -x;
    }
    do {
      digits[n++] = static_cast<char>('0' + x % 10);
      x /= 10;
    } while (x > 0 && n < 24);
    while (n > 0 && at < 1000) line[at++] = digits[--n];
  };
  for (int i = 1; i < phase_stamp_count(); ++i) {
    put(" ");
    put_number(phase_stamp_labels[k][i]);
    put(":");
    put_number(phase_stamp_cycles[k][i] - phase_stamp_cycles[k][0]);
  }
  line[at] = '\0';
  printf("phase_stamps %d sm %u ns %llu :%s\n", k, sm, phase_stamp_times[k][1] - phase_stamp_times[k][0], line);
}
#else
__device__ __forceinline__ void start_phase_stamps(stamped_kernel) {}
__device__ __forceinline__ void phase_stamp(stamped_kernel, int) {}
__device__ __forceinline__ void finish_phase_stamps(stamped_kernel, int) {}
#endif

}  // namespace shadowkv::cuda

// The decode pipeline's plan, made from what the backend knows (the batch, where its values live, the device):
// how the batch is cut into parts, how many CTAs the value fetch takes and at which priority. The cuda_backend members
// that use these (pipeline_parts, fetch_ctas, step_dims, fuse_step) are in pipeline_plan.cpp too.
#pragma once

namespace shadowkv::cuda {

/// CTAs of the value fetch when values cross PCIe: a quarter of the multiprocessors (33 on an H200), at least 8, or
/// SHADOWKV_FETCH_CTAS (environment.hpp) where it is set.
int fetch_ctas_for_host_values(int multiprocessors);

/// CTAs of the value fetch when every value of the part is in device memory: twice the multiprocessors.
int fetch_ctas_for_device_values(int multiprocessors);

/// The launch priority of a value fetch across PCIe: the current device's greatest.
int fetch_priority_for_host_values();

/// First entry of part p of `count` parts of `batch` entries, split tapered: weights 1, 2, ..., 2, 1 (three parts or
/// more), else (or where a tapered split would leave a part empty) equal parts.
int part_start(int p, int count, int batch);

}  // namespace shadowkv::cuda

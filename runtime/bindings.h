// Each binding file registers one area of the module; bindings.cpp calls them in order.
#pragma once
#include <cuda_runtime.h>
#include <nanobind/nanobind.h>

#include "drafter_weights.h"

namespace ddtree {

// Drafter dims by field name from a dict built from the drafter's config.json (ddtree.drafter_engine.drafter_dims).
DrafterDims parse_drafter_dims(const nanobind::dict& d);

// Stream the kernel-level entry points launch on (0: the legacy default stream). Benchmarks point it at a torch
// stream (kernels.use_stream) to capture the launches into a CUDA graph.
cudaStream_t& kernel_launch_stream();

void bind_kernels(nanobind::module_& m);
void bind_moe(nanobind::module_& m);
void bind_engine(nanobind::module_& m);  // after bind_kernels: adds to its submodule
void bind_tree(nanobind::module_& m);    // after bind_kernels: adds to its submodule
void bind_drafter(nanobind::module_& m);  // after bind_engine: a drafter is built beside an Engine
void bind_rank_reduce(nanobind::module_& m);  // after bind_kernels: adds to its submodule
void bind_multi_gpu(nanobind::module_& m);    // after bind_kernels: adds to its submodule too

}  // namespace ddtree

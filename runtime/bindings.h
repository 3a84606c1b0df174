// Each binding file registers one area of the module; bindings.cpp calls them in order.
#pragma once
#include <nanobind/nanobind.h>

namespace ddtree {

void bind_kernels(nanobind::module_& m);
void bind_moe(nanobind::module_& m);
void bind_engine(nanobind::module_& m);  // after bind_kernels: adds to its submodule

}  // namespace ddtree

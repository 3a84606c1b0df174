#include "nccl_communicators.h"

#include <cstdlib>
#include <set>
#include <stdexcept>
#include <string>

#include "cuda_check.h"

namespace ddtree {

NcclCommunicators::NcclCommunicators(const nccl::Library& library, const std::vector<int>& devices)
    : library_(library), comms_(devices.size(), nullptr) {
    if (devices.empty()) throw std::invalid_argument("devices: at least one CUDA device");
    if (std::set<int>(devices.begin(), devices.end()).size() != devices.size()) {
        throw std::invalid_argument("devices: each device at most once");
    }
    for (int d : devices) check_device(d, "devices: device");
    // process-wide (torch's NCCL in the same process sees it too), and set before any thread of ours reads it.
    // Peers connected at creation, not lazily at a communicator's first collective: that may be inside a graph
    // capture (a replay or timing call first on a fresh engine), and NCCL's buffers are then in the device memory
    // the engines' pre-flight finds taken.
    setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
    setenv("NCCL_RUNTIME_CONNECT", "0", /*overwrite=*/0);
    library_.check(library_.comm_init_all(comms_.data(), size(), devices.data()), "ncclCommInitAll");
}

NcclCommunicators::~NcclCommunicators() {
    if (abandoned_) return;
    for (nccl::Comm comm : comms_) library_.comm_destroy(comm);  // a destructor reports nothing
}

}  // namespace ddtree

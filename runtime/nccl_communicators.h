// The communicators of one process driving several local GPUs: one ncclCommInitAll over the devices (no
// unique-id exchange, no launcher), rank r on devices[r], destroyed together. NVLink multicast (NVLS) is turned
// off before they are created unless NCCL_NVLS_ENABLE is already set: the machines this runs on require it off,
// and the collectives here are small gathers that do not need it. Peers connect at creation
// (NCCL_RUNTIME_CONNECT=0 unless set).
#pragma once
#include <vector>

#include "nccl_collectives.h"
#include "nccl_library.h"
#include "rank_workers.h"

namespace ddtree {

class NcclCommunicators {
  public:
    // std::invalid_argument naming `devices` when they repeat, are missing, or name a device that does not exist.
    NcclCommunicators(const nccl::Library& library, const std::vector<int>& devices);
    ~NcclCommunicators();
    NcclCommunicators(const NcclCommunicators&) = delete;
    NcclCommunicators& operator=(const NcclCommunicators&) = delete;

    int size() const { return static_cast<int>(comms_.size()); }
    NcclRank rank(int r) const { return NcclRank{&library_, comms_.at(r), r, size()}; }
    // Leaves the communicators to the process's exit: ranks blocked in them for good (RankWorkers::abandoned)
    // would make ncclCommDestroy wait forever.
    void abandon() { abandoned_ = true; }

  private:
    const nccl::Library& library_;
    std::vector<nccl::Comm> comms_;
    bool abandoned_ = false;
};

// The communicators and the host threads that drive them (rank r's on devices[r]), made and given up together:
// when the threads give up ranks left waiting in a collective, the communicators go to the process's exit with
// them. Members are destroyed threads first.
struct NcclRanks {
    NcclRanks(const nccl::Library& library, const std::vector<int>& devices)
        : comms(library, devices), workers(devices) {}
    ~NcclRanks() {
        if (workers.abandoned()) comms.abandon();
    }
    NcclRanks(const NcclRanks&) = delete;
    NcclRanks& operator=(const NcclRanks&) = delete;

    NcclCommunicators comms;
    RankWorkers workers;
};

}  // namespace ddtree

// NCCL, loaded at run time: the module must import (and a one-GPU engine run) where no NCCL is installed, so the
// runtime links nothing of it and resolves the few entry points it uses from the library Python locates (the
// nvidia-nccl-cu13 wheel's libnccl.so.2, or DDTREE_NCCL_LIBRARY). The C ABI below is declared here, not included:
// the build machine has no nccl.h. Values are those of NCCL's public header (stable since NCCL 2.10).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <string>

namespace ddtree::nccl {

struct Communicator;                 // NCCL's opaque struct ncclComm
using Comm = Communicator*;          // ncclComm_t
using Result = int;                  // ncclResult_t
constexpr Result kSuccess = 0;       // ncclSuccess
enum DataType : int { kUint8 = 1, kBfloat16 = 9 };  // ncclUint8, ncclBfloat16
enum ReduceOp : int { kSum = 0 };                    // ncclSum

// The entry points, resolved once per library path and kept for the process's life (communicators may outlive
// any one engine; dlclose would pull their code from under them).
class Library {
  public:
    // The library at `path` (std::runtime_error naming the path and dlerror() when it or a symbol is missing).
    static const Library& open(const std::string& path);

    // std::runtime_error naming `call` and NCCL's error string unless `result` is success.
    void check(Result result, const char* call) const;
    // NCCL's version code, e.g. 22703 for 2.27.3.
    int version() const;

    Result (*comm_init_all)(Comm* comms, int ndev, const int* devices) = nullptr;
    Result (*comm_destroy)(Comm comm) = nullptr;
    Result (*all_gather)(const void* send, void* receive, size_t count, DataType type, Comm comm,
                         cudaStream_t stream) = nullptr;
    Result (*all_reduce)(const void* send, void* receive, size_t count, DataType type, ReduceOp op, Comm comm,
                         cudaStream_t stream) = nullptr;
    Result (*get_version)(int* version) = nullptr;
    const char* (*get_error_string)(Result result) = nullptr;

  private:
    explicit Library(std::string path);
    std::string path_;
};

}  // namespace ddtree::nccl

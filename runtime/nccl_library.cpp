#include "nccl_library.h"

#include <dlfcn.h>

#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>

namespace ddtree::nccl {

namespace {

std::string loader_error() {
    const char* e = dlerror();
    return e != nullptr ? e : "unknown dlopen error";
}

template <typename Fn>
void resolve(void* handle, const std::string& path, const char* symbol, Fn*& out) {
    dlerror();  // clear, so a null symbol value is told from a missing one
    void* found = dlsym(handle, symbol);
    if (found == nullptr) {
        throw std::runtime_error("NCCL library " + path + " lacks " + symbol + ": " + loader_error() +
                                 " (NCCL 2.10 or later is needed)");
    }
    out = reinterpret_cast<Fn*>(found);
}

}  // namespace

Library::Library(std::string path) : path_(std::move(path)) {
    // RTLD_LOCAL: its symbols stay out of the global namespace, where a host process's own NCCL (torch's) may be.
    void* handle = dlopen(path_.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
        throw std::runtime_error("cannot load the NCCL library " + path_ + ": " + loader_error() +
                                 " (install the nvidia-nccl-cu13 wheel, or set DDTREE_NCCL_LIBRARY to a libnccl.so.2)");
    }
    resolve(handle, path_, "ncclCommInitAll", comm_init_all);
    resolve(handle, path_, "ncclCommDestroy", comm_destroy);
    resolve(handle, path_, "ncclAllGather", all_gather);
    resolve(handle, path_, "ncclAllReduce", all_reduce);
    resolve(handle, path_, "ncclGetVersion", get_version);
    resolve(handle, path_, "ncclGetErrorString", get_error_string);
}

const Library& Library::open(const std::string& path) {
    static std::mutex mutex;
    static std::map<std::string, std::unique_ptr<Library>> opened;
    const std::lock_guard<std::mutex> lock(mutex);
    auto found = opened.find(path);
    if (found == opened.end()) found = opened.emplace(path, std::unique_ptr<Library>(new Library(path))).first;
    return *found->second;
}

void Library::check(Result result, const char* call) const {
    if (result != kSuccess) {
        throw std::runtime_error(std::string("NCCL error ") + std::to_string(result) + " (" +
                                 get_error_string(result) + ") in " + call);
    }
}

int Library::version() const {
    int v = 0;
    check(get_version(&v), "ncclGetVersion");
    return v;
}

}  // namespace ddtree::nccl

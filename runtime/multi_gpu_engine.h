// A target split over several GPUs of one host, driven by one process (bench/results/multigpu/NOTES.md): engine r
// on devices[r] holds rank r of G (shard.h) with NCCL collectives (nccl_collectives.h) over communicators from one
// ncclCommInitAll, and one host thread per GPU (rank_workers.h) makes each of its calls. Every call runs on all
// ranks in lockstep: the ranks enqueue the same sequence of forwards and graphs, because their inputs (requests,
// tokens picked by the replicated pick, the drafter's outputs: the drafter is whole on every rank) are the same,
// and NCCL pairs the ranks' calls by their order. The one input that is not is a measured time: the auto budgets'
// round times, which every rank measures and then replaces by one agreed table before the generation.
// Results are rank 0's, after checking that every rank generated the same tokens (and budgets).
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine.h"
#include "nccl_communicators.h"

namespace ddtree {

class MultiGpuEngine {
  public:
    // dims: the whole model's (dims.shard is set per rank: rank r of devices.size()). `nccl_library`: the path of
    // libnccl.so.2 (nccl_library.h). The engines' arguments are Engine's; each one's pre-flight checks its device
    // (and the drafter's own_lm_head, set exactly when there are several ranks).
    MultiGpuEngine(const ModelDims& dims, const RopeTable& rope, int streams, int max_context, int max_budget,
                   const std::vector<int>& devices, const std::string& nccl_library, const DrafterSpec* drafter);
    ~MultiGpuEngine();
    MultiGpuEngine(const MultiGpuEngine&) = delete;
    MultiGpuEngine& operator=(const MultiGpuEngine&) = delete;

    int ranks() const { return static_cast<int>(engines_.size()); }
    // Rank 0's dims: the global sizes, and rank 0's shard.
    const ModelDims& dims() const { return engines_.front()->dims(); }
    const std::vector<int>& devices() const { return devices_; }
    // The engine's sizes (every rank's are rank 0's), its ranks 0..ranks-1, and whether it has a drafter.
    int streams() const { return engines_.front()->streams(); }
    int max_context() const { return engines_.front()->max_context(); }
    int max_budget() const { return engines_.front()->max_budget(); }
    bool has_drafter() const { return engines_.front()->has_drafter(); }
    std::vector<int> held_ranks() const;
    // The first tensor missing on any rank ("" when complete); the drafter's, rank 0's (uploads go to every rank).
    std::string missing();
    DrafterWeights& drafter_weights() { return engines_.front()->drafter_weights(); }
    // Rank r's engine (std::invalid_argument naming `rank` outside 0..ranks-1): weight uploads, properties.
    Engine& rank(int r);
    // job(rank, rank's engine) on every rank's thread at once (RankWorkers::run: a rank failing between collectives,
    // or ranks diverging, leaves the others waiting for good; it then throws, and every later call does).
    void on_every_rank(const std::function<void(int, Engine&)>& job, bool collectives = true);

    // Random weights: rank r's split tensors drawn with seed + r (as the one-GPU simulation of every rank draws
    // them), its replicated tensors rank 0's, so the G GPUs compute the simulation's model.
    void randomize_weights(uint64_t seed);
    // The drafter is whole on every rank: the same draw everywhere.
    void randomize_drafter(uint64_t seed);

    Generation generate(const std::vector<std::vector<int32_t>>& prompts, int max_new_tokens, float temperature,
                        uint64_t seed);
    TreeGeneration generate_ddtree(RoundRequest request);
    // Engine::forward_logits on every rank, each rank's vocabulary slice put together: [rows, vocab].
    std::vector<float> forward_logits(const std::vector<int32_t>& ids, const std::vector<int32_t>& streams,
                                      const std::vector<int32_t>& positions);
    // The slowest rank's device and host seconds per replayed decode step (each rank replays the same steps).
    std::pair<double, double> time_decode(int n, const std::vector<int32_t>& positions, int iters, float temperature,
                                          uint64_t seed);
    // Rank 0's captured graphs (every rank captures the same keys).
    std::vector<CapturedGraph> graphs() const;
    // Every rank replays `name` n times; the slowest rank's seconds of each replay.
    std::vector<double> replay(const std::string& name, int n, bool warmup);

  private:
    std::vector<int> devices_;
    NcclRanks ranks_;  // outlives the engines, whose graphs hold NCCL work on its communicators
    std::vector<std::unique_ptr<Engine>> engines_;
};

}  // namespace ddtree

// Absorbed-MLA attention: one CTA per (query row, chunk of kMlaChunk keys, group of 64 heads), then a merge
// of the chunk partials in chunk order. All 64 heads share each key tile, so the latent cache is read once.
#include <cmath>

#include "gemm_mma.cuh"
#include "mla_attn.cuh"

namespace ddtree::kernels {
namespace {

constexpr int kHeads = 64;      // heads per CTA: four m16 tiles
constexpr int kWarps = 16;      // S: 4 head tiles x 4 key octets; PV: 4 head tiles x 4 latent column quarters
static_assert(kWarps * 32 == kHeads * 8, "softmax: 8 threads per head row");
constexpr int kThreads = kWarps * 32;
constexpr int kTileKeys = 32;
constexpr int kStages = 3;
constexpr int kSLd = kTileKeys + 1;  // fp32 scores, padded against bank conflicts
constexpr int kPLd = kTileKeys + 8;  // bf16 probabilities, rows 16-byte aligned for ldmatrix
constexpr float kLog2e = 1.4426950408889634f;

template <int DL, int DR>
struct Layout {
    static constexpr int D = DL + DR;
    static constexpr int LD = D + 8;  // smem row stride (elements): 16-byte aligned, shifts banks per row
    static constexpr int q_elems = kHeads * LD;
    static constexpr int kv_elems = kStages * kTileKeys * LD;
    static constexpr size_t bytes = (q_elems + kv_elems) * 2 + kHeads * kSLd * 4 + kHeads * kPLd * 2 + 3 * kHeads * 4;
};

template <int DL, int DR>
__global__ void __launch_bounds__(kThreads, 1)
    mla_chunk_kernel(const bf16* __restrict__ q, const bf16* __restrict__ cache, const int32_t* kv_start,
                     const int32_t* kv_len, int heads, float scale_log2, float* part_o, float* part_ml,
                     int max_chunks) {
    using L = Layout<DL, DR>;
    constexpr int D = L::D, LD = L::LD, NTW = DL / 32;  // n8 tiles per warp in P.V
    static_assert(D % 16 == 0 && DL % 32 == 0, "unsupported MLA dims");
    const int chunk = blockIdx.x, row = blockIdx.y, h0 = blockIdx.z * kHeads;
    const int len = kv_len[row];
    const int key0 = chunk * kMlaChunk;
    if (key0 >= len) {
        return;
    }
    const int nkeys = min(kMlaChunk, len - key0);
    const int ntiles = (nkeys + kTileKeys - 1) / kTileKeys;
    const bf16* kv = cache + (static_cast<int64_t>(kv_start[row]) + key0) * D;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;

    extern __shared__ __align__(16) unsigned char smem[];
    bf16* s_q = reinterpret_cast<bf16*>(smem);
    bf16* s_kv = s_q + L::q_elems;
    float* s_s = reinterpret_cast<float*>(s_kv + L::kv_elems);
    bf16* s_p = reinterpret_cast<bf16*>(s_s + kHeads * kSLd);
    float* s_alpha = reinterpret_cast<float*>(s_p + kHeads * kPLd);
    float* s_m = s_alpha + kHeads;
    float* s_l = s_m + kHeads;

    for (int idx = tid; idx < kHeads * (D / 8); idx += kThreads) {
        const int r = idx / (D / 8), c = idx % (D / 8);
        const bool valid = h0 + r < heads;
        cp_async16_zfill(s_q + r * LD + c * 8, q + (static_cast<int64_t>(row) * heads + (valid ? h0 + r : 0)) * D + c * 8,
                         valid);
    }
    auto issue = [&](int tile) {
        bf16* dst = s_kv + (tile % kStages) * kTileKeys * LD;
        for (int idx = tid; idx < kTileKeys * (D / 8); idx += kThreads) {
            const int key = idx / (D / 8), c = idx % (D / 8);
            const int k = tile * kTileKeys + key;
            const bool valid = k < nkeys;
            cp_async16_zfill(dst + key * LD + c * 8, kv + static_cast<int64_t>(valid ? k : 0) * D + c * 8, valid);
        }
    };
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
        if (s < ntiles) issue(s);
        cp_async_commit();
    }
    if (tid < kHeads) {
        s_m[tid] = -INFINITY;
        s_l[tid] = 0.f;
    }

    const int mt = warp / 4, sub = warp % 4;
    float o[NTW][4];
#pragma unroll
    for (int n = 0; n < NTW; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;

    for (int tile = 0; tile < ntiles; ++tile) {
        cp_async_wait<kStages - 2>();
        __syncthreads();  // this tile is visible to all; every warp is done with the stage refilled next
        if (tile + kStages - 1 < ntiles) issue(tile + kStages - 1);
        cp_async_commit();
        const bf16* kvs = s_kv + (tile % kStages) * kTileKeys * LD;

        // Scores for heads 16*mt.. and keys 8*sub.. of this tile, over the whole latent + rope dim: four
        // independent MMA chains (k16 step i feeds chain i % 4), summed in a fixed order.
        float acc4[4][4] = {};
#pragma unroll
        for (int kk = 0; kk < D; kk += 16) {
            uint32_t a[4], b[2];
            ldmatrix_x4(a, s_q + (16 * mt + lane % 16) * LD + kk + (lane / 16) * 8);
            ldmatrix_x2(b, kvs + (8 * sub + lane % 8) * LD + kk + ((lane / 8) % 2) * 8);
            mma_bf16_16816(acc4[(kk / 16) % 4], a[0], a[1], a[2], a[3], b[0], b[1]);
        }
        float s[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) s[i] = (acc4[0][i] + acc4[1][i]) + (acc4[2][i] + acc4[3][i]);
        const int key = 8 * sub + 2 * t;
        const bool v0 = tile * kTileKeys + key < nkeys, v1 = tile * kTileKeys + key + 1 < nkeys;
        s_s[(16 * mt + g) * kSLd + key] = v0 ? s[0] * scale_log2 : -INFINITY;
        s_s[(16 * mt + g) * kSLd + key + 1] = v1 ? s[1] * scale_log2 : -INFINITY;
        s_s[(16 * mt + g + 8) * kSLd + key] = v0 ? s[2] * scale_log2 : -INFINITY;
        s_s[(16 * mt + g + 8) * kSLd + key + 1] = v1 ? s[3] * scale_log2 : -INFINITY;
        __syncthreads();

        // Online softmax: 8 threads per head row, 4 keys each; base-2 exponent (the scale holds log2(e)).
        {
            constexpr int kPer = kTileKeys / 8;
            const int r = tid / 8, part = tid % 8;
            const float m_old = s_m[r];
            float v[kPer], m_new = m_old;
#pragma unroll
            for (int j = 0; j < kPer; ++j) {
                v[j] = s_s[r * kSLd + part * kPer + j];
                m_new = fmaxf(m_new, v[j]);
            }
#pragma unroll
            for (int offset = 1; offset < 8; offset <<= 1) {
                m_new = fmaxf(m_new, __shfl_xor_sync(0xffffffffu, m_new, offset));
            }
            float sum = 0.f;
#pragma unroll
            for (int j = 0; j < kPer; ++j) {
                const float p = exp2f(v[j] - m_new);
                sum += p;
                s_p[r * kPLd + part * kPer + j] = __float2bfloat16(p);
            }
#pragma unroll
            for (int offset = 1; offset < 8; offset <<= 1) {
                sum += __shfl_xor_sync(0xffffffffu, sum, offset);
            }
            __syncwarp();  // every thread of the row has read s_m[r] before part 0 overwrites it
            if (part == 0) {
                const float alpha = exp2f(m_old - m_new);
                s_l[r] = s_l[r] * alpha + sum;
                s_m[r] = m_new;
                s_alpha[r] = alpha;
            }
        }
        __syncthreads();

        // O[heads 16*mt.., latent columns of quarter `sub`] = O * alpha + P . V
        const float alpha_lo = s_alpha[16 * mt + g], alpha_hi = s_alpha[16 * mt + g + 8];
#pragma unroll
        for (int n = 0; n < NTW; ++n) {
            o[n][0] *= alpha_lo;
            o[n][1] *= alpha_lo;
            o[n][2] *= alpha_hi;
            o[n][3] *= alpha_hi;
        }
#pragma unroll
        for (int ks = 0; ks < kTileKeys; ks += 16) {
            uint32_t a[4];
            ldmatrix_x4(a, s_p + (16 * mt + lane % 16) * kPLd + ks + (lane / 16) * 8);
            const bf16* v_rows = kvs + (ks + lane % 8 + ((lane / 8) % 2) * 8) * LD + sub * (DL / 4);
#pragma unroll
            for (int n = 0; n + 1 < NTW; n += 2) {
                uint32_t b[4];
                ldmatrix_x4_trans(b, v_rows + n * 8 + (lane / 16) * 8);
                mma_bf16_16816(o[n], a[0], a[1], a[2], a[3], b[0], b[1]);
                mma_bf16_16816(o[n + 1], a[0], a[1], a[2], a[3], b[2], b[3]);
            }
            if constexpr (NTW % 2) {
                uint32_t b[2];
                ldmatrix_x2_trans(b, v_rows + (NTW - 1) * 8);
                mma_bf16_16816(o[NTW - 1], a[0], a[1], a[2], a[3], b[0], b[1]);
            }
        }
    }
    cp_async_wait<0>();

    const int64_t part = static_cast<int64_t>(row) * max_chunks + chunk;
    const int head_lo = h0 + 16 * mt + g, head_hi = head_lo + 8;
#pragma unroll
    for (int n = 0; n < NTW; ++n) {
        const int col = sub * (DL / 4) + n * 8 + 2 * t;
        if (head_lo < heads) {
            *reinterpret_cast<float2*>(part_o + (part * heads + head_lo) * DL + col) = make_float2(o[n][0], o[n][1]);
        }
        if (head_hi < heads) {
            *reinterpret_cast<float2*>(part_o + (part * heads + head_hi) * DL + col) = make_float2(o[n][2], o[n][3]);
        }
    }
    if (tid < kHeads && h0 + tid < heads) {
        part_ml[(part * heads + h0 + tid) * 2] = s_m[tid];
        part_ml[(part * heads + h0 + tid) * 2 + 1] = s_l[tid];
    }
}

// out[row, head] = sum_c 2^(m_c - m) O_c / sum_c 2^(m_c - m) l_c, chunks in order.
__global__ void mla_merge_kernel(bf16* out, const float* part_o, const float* part_ml, const int32_t* kv_len,
                                 int heads, int dl, int max_chunks) {
    const int row = blockIdx.x, head = blockIdx.y;
    const int chunks = (kv_len[row] + kMlaChunk - 1) / kMlaChunk;
    const int64_t first = static_cast<int64_t>(row) * max_chunks;
    float m = -INFINITY;
    for (int c = 0; c < chunks; ++c) m = fmaxf(m, part_ml[((first + c) * heads + head) * 2]);
    for (int col = threadIdx.x; col < dl; col += blockDim.x) {
        float acc = 0.f, denom = 0.f;
        for (int c = 0; c < chunks; ++c) {
            const int64_t p = (first + c) * heads + head;
            const float w = exp2f(part_ml[p * 2] - m);
            acc += w * part_o[p * dl + col];
            denom += w * part_ml[p * 2 + 1];
        }
        out[(static_cast<int64_t>(row) * heads + head) * dl + col] = __float2bfloat16(acc / denom);
    }
}

template <int DL, int DR>
cudaError_t launch(bf16* out, const bf16* q, const bf16* cache, const int32_t* kv_start, const int32_t* kv_len,
                   int rows, int max_len, int heads, float softmax_scale, float* workspace, cudaStream_t stream) {
    using L = Layout<DL, DR>;
    const int max_chunks = (max_len + kMlaChunk - 1) / kMlaChunk;
    float* part_o = workspace;
    float* part_ml = workspace + static_cast<int64_t>(rows) * max_chunks * heads * DL;
    static std::atomic<uint64_t> configured{0};
    DDTREE_RETURN_IF_ERROR(opt_in_smem(mla_chunk_kernel<DL, DR>, static_cast<int>(L::bytes), configured));
    const dim3 grid(max_chunks, rows, (heads + kHeads - 1) / kHeads);
    mla_chunk_kernel<DL, DR><<<grid, kThreads, L::bytes, stream>>>(q, cache, kv_start, kv_len, heads,
                                                                   softmax_scale * kLog2e, part_o, part_ml,
                                                                   max_chunks);
    DDTREE_RETURN_IF_ERROR(cudaGetLastError());
    mla_merge_kernel<<<dim3(rows, heads), 128, 0, stream>>>(out, part_o, part_ml, kv_len, heads, DL, max_chunks);
    return cudaGetLastError();
}

}  // namespace

// Compiled (kv_lora, rope_dim) pairs: K2 and the synthetic test presets.
#define DDTREE_MLA_DIMS(X) X(512, 64) X(128, 32) X(32, 16)

bool mla_dims_supported(int kv_lora, int rope_dim) {
#define DDTREE_MLA_MATCH(dl, dr) if (kv_lora == dl && rope_dim == dr) return true;
    DDTREE_MLA_DIMS(DDTREE_MLA_MATCH)
#undef DDTREE_MLA_MATCH
    return false;
}

int64_t mla_workspace_floats(const MlaDims& dims, int max_rows, int max_len) {
    const int64_t chunks = (max_len + kMlaChunk - 1) / kMlaChunk;
    return static_cast<int64_t>(max_rows) * chunks * dims.heads * (dims.kv_lora + 2);
}

cudaError_t mla_attention(bf16* out, const bf16* q, const bf16* cache, const int32_t* kv_start,
                          const int32_t* kv_len, int rows, int max_len, const MlaDims& dims, float softmax_scale,
                          float* workspace, cudaStream_t stream) {
    if (rows < 0 || max_len <= 0 || dims.heads <= 0) {
        return cudaErrorInvalidValue;
    }
    if (rows == 0) {
        return cudaSuccess;
    }
#define DDTREE_MLA_LAUNCH(dl, dr)                                                                           \
    if (dims.kv_lora == dl && dims.rope_dim == dr)                                                          \
        return launch<dl, dr>(out, q, cache, kv_start, kv_len, rows, max_len, dims.heads, softmax_scale, \
                              workspace, stream);
    DDTREE_MLA_DIMS(DDTREE_MLA_LAUNCH)
#undef DDTREE_MLA_LAUNCH
    return cudaErrorInvalidValue;
}

}  // namespace ddtree::kernels

// GQA block attention of the DFlash drafter (see gqa_attn.cuh): chunk kernel, then the in-order merge.
#include "gqa_attn.cuh"

#include <algorithm>
#include <atomic>

#include "gemm_mma.cuh"

namespace ddtree::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kQTile = 64;    // (block row, query head) pairs of one KV head per CTA
constexpr int kKeyTile = 64;  // keys per pass through shared memory
constexpr float kLog2e = 1.4426950408889634f;
static_assert(kGqaChunkKeys % kKeyTile == 0, "a chunk is whole key tiles");

// Shared memory of a CTA for head_dim hd: the scaled queries (fp32), one key tile (bf16 pairs, rows padded by one
// word so that the 16 keys a warp reads at once fall in distinct banks), one value tile, the tile's scores and
// probabilities, and each query's running max, sum and rescale factor.
struct Smem {
    __host__ __device__ static int key_words(int hd) { return hd / 2 + 1; }
    static size_t bytes(int hd) {
        return sizeof(float) * kQTile * hd + sizeof(uint32_t) * kKeyTile * key_words(hd) +
               sizeof(bf16) * kKeyTile * hd + sizeof(float) * kQTile * (kKeyTile + 1) + sizeof(float) * 3 * kQTile;
    }
};

__host__ __device__ int chunks_for(int keys) { return (keys + kGqaChunkKeys - 1) / kGqaChunkKeys; }

__device__ __forceinline__ int context_rows(const GqaKeys& k, int s) { return min(k.starts[s], k.capacity); }

// Partial results of entry e of E entries: max at ws[e], sum at ws[E + e], P.V at ws[2E + e * hd ..].
struct Partials {
    float* ws;
    int64_t entries;
    __device__ __forceinline__ int64_t entry(int s, int chunk, int max_chunks, int heads, int h, int block, int j) const {
        return ((static_cast<int64_t>(s) * max_chunks + chunk) * heads + h) * block + j;
    }
};

// kCols: value columns per lane (head_dim <= 32 kCols).
template <int kCols>
__global__ void __launch_bounds__(kThreads)
    gqa_chunk_kernel(const bf16* __restrict__ q, GqaKeys keys, GqaDims d, float scale_log2, int max_chunks,
                     Partials part) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const int hd = d.head_dim, kw = Smem::key_words(hd);
    float* q_s = reinterpret_cast<float*>(smem_raw);
    uint32_t* k_s = reinterpret_cast<uint32_t*>(q_s + kQTile * hd);
    bf16* v_s = reinterpret_cast<bf16*>(k_s + kKeyTile * kw);
    float* p_s = reinterpret_cast<float*>(v_s + kKeyTile * hd);
    float* row_m = p_s + kQTile * (kKeyTile + 1);
    float* row_l = row_m + kQTile;
    float* row_alpha = row_l + kQTile;

    dependent_kernel_start();
    const int chunk = blockIdx.x, s = blockIdx.z;
    const int group = d.heads / d.kv_heads, pairs = d.block * group;
    const int q_tiles = (pairs + kQTile - 1) / kQTile;
    const int kvh = blockIdx.y / q_tiles, q0 = (blockIdx.y % q_tiles) * kQTile;
    const int n_ctx = context_rows(keys, s), n_keys = n_ctx + d.block;
    const int key0 = chunk * kGqaChunkKeys;
    if (key0 >= n_keys) return;
    const int key_end = min(key0 + kGqaChunkKeys, n_keys);
    const int t = threadIdx.x;

    // Query pair p = (block row p / group, head kvh * group + p % group), scaled into log2 units.
    for (int i = t; i < kQTile * hd; i += kThreads) {
        const int p = q0 + i / hd, e = i % hd;
        float v = 0.f;
        if (p < pairs) {
            const int64_t row = static_cast<int64_t>(s) * d.block + p / group;
            v = __bfloat162float(q[(row * d.heads + kvh * group + p % group) * hd + e]) * scale_log2;
        }
        q_s[i] = v;
    }
    if (t < kQTile) {
        row_m[t] = -INFINITY;
        row_l[t] = 0.f;
    }
    const int64_t cache_base = static_cast<int64_t>(keys.cache_streams[s]) * keys.capacity;
    const int warp = t / 32, lane = t % 32;
    float acc[8][kCols] = {};  // query pairs warp * 8 + i, columns lane + 32 c

    for (int tile0 = key0; tile0 < key_end; tile0 += kKeyTile) {
        // Key and value rows of the tile (zeros past the chunk's end), 8 bf16 at a time.
        const int vecs = hd / 8;
        for (int i = t; i < kKeyTile * vecs; i += kThreads) {
            const int kk = i / vecs, e = (i % vecs) * 8, key = tile0 + kk;
            uint4 kv = make_uint4(0, 0, 0, 0), vv = kv;
            if (key < key_end) {
                const bf16 *kp, *vp;
                if (key < n_ctx) {
                    const int64_t off = ((cache_base + key) * d.kv_heads + kvh) * hd + e;
                    kp = keys.ctx_k + off;
                    vp = keys.ctx_v + off;
                } else {
                    const int64_t row = static_cast<int64_t>(s) * d.block + (key - n_ctx);
                    kp = keys.block_k + row * keys.block_k_ld + kvh * hd + e;
                    vp = keys.block_v + row * keys.block_v_ld + kvh * hd + e;
                }
                kv = *reinterpret_cast<const uint4*>(kp);
                vv = *reinterpret_cast<const uint4*>(vp);
            }
            uint32_t* kd = k_s + kk * kw + e / 2;
            kd[0] = kv.x;
            kd[1] = kv.y;
            kd[2] = kv.z;
            kd[3] = kv.w;
            *reinterpret_cast<uint4*>(v_s + kk * hd + e) = vv;
        }
        __syncthreads();

        // Scores: thread t takes query pairs 4 (t / 16) + i and keys t % 16 + 16 jj.
        {
            const int qa = (t / 16) * 4, kb = t % 16;
            float sc[4][4] = {};
            for (int w2 = 0; w2 < hd / 2; ++w2) {
                float2 kf[4];
#pragma unroll
                for (int jj = 0; jj < 4; ++jj) {
                    const uint32_t word = k_s[(kb + 16 * jj) * kw + w2];
                    kf[jj] = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&word));
                }
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const float2 qf = *reinterpret_cast<const float2*>(q_s + (qa + i) * hd + 2 * w2);
#pragma unroll
                    for (int jj = 0; jj < 4; ++jj) sc[i][jj] += qf.x * kf[jj].x + qf.y * kf[jj].y;
                }
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) {
#pragma unroll
                for (int jj = 0; jj < 4; ++jj) {
                    const int kk = kb + 16 * jj;
                    p_s[(qa + i) * (kKeyTile + 1) + kk] = tile0 + kk < key_end ? sc[i][jj] : -INFINITY;
                }
            }
        }
        __syncthreads();

        // Online softmax: four neighbouring lanes per query pair, 16 keys each.
        {
            const int row = t / 4, part = t % 4;
            float* pr = p_s + row * (kKeyTile + 1) + part * 16;
            float tile_max = -INFINITY;
#pragma unroll
            for (int j = 0; j < 16; ++j) tile_max = fmaxf(tile_max, pr[j]);
            tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
            tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
            const float m_old = row_m[row], m_new = fmaxf(m_old, tile_max);  // finite: a tile has a key
            float sum = 0.f;
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                const float p = exp2f(pr[j] - m_new);
                pr[j] = p;
                sum += p;
            }
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            if (part == 0) {
                const float alpha = exp2f(m_old - m_new);
                row_alpha[row] = alpha;
                row_l[row] = row_l[row] * alpha + sum;
                row_m[row] = m_new;
            }
        }
        __syncthreads();

        // P.V: warp w's query pairs 8w .. 8w + 7, lane's columns lane + 32 c.
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const float alpha = row_alpha[warp * 8 + i];
#pragma unroll
            for (int c = 0; c < kCols; ++c) acc[i][c] *= alpha;
        }
        const int tile_keys = min(kKeyTile, key_end - tile0);
        for (int kk = 0; kk < tile_keys; ++kk) {
            float v[kCols];
#pragma unroll
            for (int c = 0; c < kCols; ++c) {
                const int e = lane + 32 * c;
                v[c] = e < hd ? __bfloat162float(v_s[kk * hd + e]) : 0.f;
            }
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const float p = p_s[(warp * 8 + i) * (kKeyTile + 1) + kk];
#pragma unroll
                for (int c = 0; c < kCols; ++c) acc[i][c] += p * v[c];
            }
        }
        __syncthreads();
    }

#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int p = q0 + warp * 8 + i;
        if (p >= pairs) continue;
        const int64_t e = part.entry(s, chunk, max_chunks, d.heads, kvh * group + p % group, d.block, p / group);
        if (lane == 0) {
            part.ws[e] = row_m[warp * 8 + i];
            part.ws[part.entries + e] = row_l[warp * 8 + i];
        }
#pragma unroll
        for (int c = 0; c < kCols; ++c) {
            const int col = lane + 32 * c;
            if (col < hd) part.ws[2 * part.entries + e * hd + col] = acc[i][c];
        }
    }
}

// out row s * block + j, head h: the chunks' partials rescaled to their common max and added in chunk order.
__global__ void __launch_bounds__(128)
    gqa_merge_kernel(bf16* __restrict__ out, GqaKeys keys, GqaDims d, int max_chunks, Partials part) {
    dependent_kernel_start();
    const int row = blockIdx.x, h = blockIdx.y;
    const int s = row / d.block, j = row % d.block;
    const int chunks = chunks_for(context_rows(keys, s) + d.block);
    float m = -INFINITY;
    for (int c = 0; c < chunks; ++c) m = fmaxf(m, part.ws[part.entry(s, c, max_chunks, d.heads, h, d.block, j)]);
    float total = 0.f;
    for (int c = 0; c < chunks; ++c) {
        const int64_t e = part.entry(s, c, max_chunks, d.heads, h, d.block, j);
        total += part.ws[part.entries + e] * exp2f(part.ws[e] - m);
    }
    const float inv = 1.f / total;
    for (int col = threadIdx.x; col < d.head_dim; col += blockDim.x) {
        float o = 0.f;
        for (int c = 0; c < chunks; ++c) {
            const int64_t e = part.entry(s, c, max_chunks, d.heads, h, d.block, j);
            o += part.ws[2 * part.entries + e * d.head_dim + col] * exp2f(part.ws[e] - m);
        }
        out[(static_cast<int64_t>(row) * d.heads + h) * d.head_dim + col] = __float2bfloat16(o * inv);
    }
}

int64_t entries(const GqaDims& d, int streams, int max_chunks) {
    return static_cast<int64_t>(streams) * max_chunks * d.heads * d.block;
}

template <int kCols>
cudaError_t launch_chunks(const bf16* q, const GqaKeys& keys, const GqaDims& d, float scale_log2, int streams,
                          int max_chunks, const Partials& part, cudaStream_t stream) {
    static std::atomic<uint64_t> configured{0};
    DDTREE_RETURN_IF_ERROR(
        opt_in_smem(gqa_chunk_kernel<kCols>, static_cast<int>(Smem::bytes(32 * kCols)), configured));
    const int pairs = d.block * (d.heads / d.kv_heads);
    const dim3 grid(max_chunks, d.kv_heads * ((pairs + kQTile - 1) / kQTile), streams);
    return launch_dependent(gqa_chunk_kernel<kCols>, grid, dim3(kThreads), Smem::bytes(d.head_dim), stream, q, keys,
                            d, scale_log2, max_chunks, part);
}

}  // namespace

bool gqa_supported(const GqaDims& d) {
    return d.heads > 0 && d.kv_heads > 0 && d.heads % d.kv_heads == 0 && d.head_dim > 0 && d.head_dim % 8 == 0 &&
           d.head_dim <= kGqaMaxHeadDim && d.block > 0;
}

int64_t gqa_workspace_floats(const GqaDims& d, int streams, int max_ctx) {
    return entries(d, streams, chunks_for(max_ctx + d.block)) * (d.head_dim + 2);
}

cudaError_t gqa_attention(bf16* out, const bf16* q, const GqaKeys& keys, int streams, int span, const GqaDims& d,
                          float scale, float* workspace, cudaStream_t stream) {
    if (!gqa_supported(d) || streams < 0 || span < 0 || span > keys.capacity || keys.block_k_ld % 8 ||
        keys.block_v_ld % 8) {
        return cudaErrorInvalidValue;
    }
    if (streams == 0) return cudaSuccess;
    const int max_chunks = chunks_for(span + d.block);
    const Partials part{workspace, entries(d, streams, max_chunks)};
    const float scale_log2 = scale * kLog2e;
    cudaError_t err = cudaErrorInvalidValue;
    if (d.head_dim <= 32) {
        err = launch_chunks<1>(q, keys, d, scale_log2, streams, max_chunks, part, stream);
    } else if (d.head_dim <= 64) {
        err = launch_chunks<2>(q, keys, d, scale_log2, streams, max_chunks, part, stream);
    } else if (d.head_dim <= 128) {
        err = launch_chunks<4>(q, keys, d, scale_log2, streams, max_chunks, part, stream);
    } else {
        err = launch_chunks<8>(q, keys, d, scale_log2, streams, max_chunks, part, stream);
    }
    DDTREE_RETURN_IF_ERROR(err);
    return launch_dependent(gqa_merge_kernel, dim3(streams * d.block, d.heads), dim3(128), 0, stream, out, keys, d,
                            max_chunks, part);
}

}  // namespace ddtree::kernels

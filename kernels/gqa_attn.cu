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

// Shared memory of a CTA for head_dim hd: the queries, and two stages of one key tile's keys and values (bf16
// rows of hd rounded up to whole k16 steps, zero-padded, plus 8 elements so that a warp's fragment loads fall in
// distinct banks), the tile's scores and probabilities (fp32), and each query pair's running max, sum and rescale
// factor. The next tile's rows arrive by cp.async while the current one is used.
struct Smem {
    __host__ __device__ static int padded(int hd) { return (hd + 15) / 16 * 16; }
    __host__ __device__ static int ld(int hd) { return padded(hd) + 8; }
    static size_t bytes(int hd) {
        return sizeof(bf16) * (kQTile + 4 * kKeyTile) * ld(hd) + sizeof(float) * kQTile * (kKeyTile + 1) +
               sizeof(float) * 3 * kQTile;
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

__device__ __forceinline__ uint32_t smem_word(const bf16* p) { return *reinterpret_cast<const uint32_t*>(p); }

// Four 8x8 bf16 matrices, transposed: lanes 8m .. 8m + 7 give the row addresses of matrix m.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(smem)));
}

// Tensor-core tiles (mma m16n8k16, fragment layout in gemm_mma.cuh; g = lane / 4, t = lane % 4). Scores: warp w
// takes query rows 16 (w / 2) .. + 15 and keys 32 (w % 2) .. + 31. P.V: warp w takes query rows 16 (w % 4) .. + 15
// and value columns 8 n for the kNT column tiles n = (w / 4) kNT + j that exist (head_dim / 8 of them); their B
// fragments come from the row-major value tile through transposing ldmatrix, two column tiles at a time.
template <int kNT>
__global__ void __launch_bounds__(kThreads)
    gqa_chunk_kernel(const bf16* __restrict__ q, GqaKeys keys, GqaDims d, float scale_log2, int max_chunks,
                     Partials part) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const int hd = d.head_dim, hd16 = Smem::padded(hd), ld = Smem::ld(hd);
    bf16* q_s = reinterpret_cast<bf16*>(smem_raw);
    bf16* kv_s = q_s + kQTile * ld;  // stage i: keys at kv_s + 2 i kKeyTile ld, values kKeyTile ld further
    float* p_s = reinterpret_cast<float*>(kv_s + 4 * kKeyTile * ld);
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
    const int t = threadIdx.x, warp = t / 32, lane = t % 32, g = lane / 4, tq = lane % 4;

    // Query pair p = (block row p / group, head kvh * group + p % group); zeros past the pairs and head_dim.
    for (int i = t; i < kQTile * hd16; i += kThreads) {
        const int p = q0 + i / hd16, e = i % hd16;
        bf16 v = __float2bfloat16(0.f);
        if (p < pairs && e < hd) {
            const int64_t row = static_cast<int64_t>(s) * d.block + p / group;
            v = q[(row * d.heads + kvh * group + p % group) * hd + e];
        }
        q_s[(i / hd16) * ld + e] = v;
    }
    if (t < kQTile) {
        row_m[t] = -INFINITY;
        row_l[t] = 0.f;
    }
    const int64_t cache_base = static_cast<int64_t>(keys.cache_streams[s]) * keys.capacity;
    const int col_tiles = hd / 8;
    float acc[kNT][4] = {};

    // Tile rows by cp.async, 16 bytes at a time (zeros past the chunk's end and in the padding). Lane l of each
    // group of 32 copies key (l % 16) + 16 (group % 4) at column 8 (2 (group / 4) + l / 16): two lanes fill a
    // 32-byte sector of a row, and a quarter warp's smem rows fall in distinct banks.
    auto load_tile = [&](int tile0, int stage) {
        bf16* k_dst = kv_s + 2 * stage * kKeyTile * ld;
        bf16* v_dst = k_dst + kKeyTile * ld;
        const int vecs = hd16 / 8;
        for (int i = t; i < kKeyTile * vecs; i += kThreads) {
            const int lane_i = i % 32, grp = i / 32;
            const int kk = lane_i % 16 + 16 * (grp % 4), e = 8 * (2 * (grp / 4) + lane_i / 16);
            const int key = tile0 + kk;
            const bool valid = key < key_end && e < hd;
            const bf16 *kp = keys.ctx_k, *vp = keys.ctx_v;  // any valid address when not copying
            if (valid && key < n_ctx) {
                const int64_t off = ((cache_base + key) * d.kv_heads + kvh) * hd + e;
                kp = keys.ctx_k + off;
                vp = keys.ctx_v + off;
            } else if (valid) {
                const int64_t row = static_cast<int64_t>(s) * d.block + (key - n_ctx);
                kp = keys.block_k + row * keys.block_k_ld + kvh * hd + e;
                vp = keys.block_v + row * keys.block_v_ld + kvh * hd + e;
            }
            cp_async16_zfill(k_dst + kk * ld + e, kp, valid);
            cp_async16_zfill(v_dst + kk * ld + e, vp, valid);
        }
        cp_async_commit();
    };
    load_tile(key0, 0);
    int stage = 0;
    for (int tile0 = key0; tile0 < key_end; tile0 += kKeyTile, stage ^= 1) {
        const bf16* k_s = kv_s + 2 * stage * kKeyTile * ld;
        const bf16* v_s = k_s + kKeyTile * ld;
        if (tile0 + kKeyTile < key_end) {
            load_tile(tile0 + kKeyTile, stage ^ 1);  // the other stage was released by the last tile's final sync
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();

        // Scores in log2 units; -inf past the chunk's end.
        {
            const int r0 = 16 * (warp / 2), n0 = 32 * (warp % 2);
            float c[4][4] = {};
            for (int k0 = 0; k0 < hd16; k0 += 16) {
                const bf16* qa = q_s + (r0 + g) * ld + k0 + 2 * tq;
                const uint32_t a0 = smem_word(qa), a1 = smem_word(qa + 8 * ld), a2 = smem_word(qa + 8),
                               a3 = smem_word(qa + 8 * ld + 8);
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const bf16* kb = k_s + (n0 + 8 * j + g) * ld + k0 + 2 * tq;
                    mma_bf16_16816(c[j], a0, a1, a2, a3, smem_word(kb), smem_word(kb + 8));
                }
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int col = n0 + 8 * j + 2 * tq;
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    float* pr = p_s + (r0 + g + 8 * h) * (kKeyTile + 1) + col;
                    pr[0] = tile0 + col < key_end ? c[j][2 * h] * scale_log2 : -INFINITY;
                    pr[1] = tile0 + col + 1 < key_end ? c[j][2 * h + 1] * scale_log2 : -INFINITY;
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
            // Only the lane that rewrites the row's statistics reads them (the others get m_old by shuffle): a
            // shuffle orders no shared-memory access, so other lanes' reads would race with its write.
            const float m_old = __shfl_sync(0xffffffffu, part == 0 ? row_m[row] : 0.f, 0, 4);
            const float m_new = fmaxf(m_old, tile_max);  // finite: a tile has a key
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

        // P.V with the probabilities rounded to bf16 (the sums above stay fp32).
        {
            const int r0 = 16 * (warp % 4), nt0 = (warp / 4) * kNT;
            const float alpha_lo = row_alpha[r0 + g], alpha_hi = row_alpha[r0 + g + 8];
#pragma unroll
            for (int j = 0; j < kNT; ++j) {
                acc[j][0] *= alpha_lo;
                acc[j][1] *= alpha_lo;
                acc[j][2] *= alpha_hi;
                acc[j][3] *= alpha_hi;
            }
#pragma unroll
            for (int k0 = 0; k0 < kKeyTile; k0 += 16) {
                const float* pa = p_s + (r0 + g) * (kKeyTile + 1) + k0 + 2 * tq;
                const float* pb = pa + 8 * (kKeyTile + 1);
                const uint32_t a0 = pack_bf16x2(pa[0], pa[1]), a1 = pack_bf16x2(pb[0], pb[1]),
                               a2 = pack_bf16x2(pa[8], pa[9]), a3 = pack_bf16x2(pb[8], pb[9]);
                // Lane l addresses key k0 + l % 8 + 8 ((l / 8) % 2) at column tile nt + l / 16.
                const int key_row = k0 + lane % 8 + 8 * ((lane / 8) % 2);
#pragma unroll
                for (int j = 0; j < kNT; j += 2) {
                    if (nt0 + j >= col_tiles) break;  // tile nt0 + j + 1 may lie in the zero padding
                    uint32_t b[4];
                    ldmatrix_x4_trans(b, v_s + key_row * ld + 8 * (nt0 + j + lane / 16));
                    mma_bf16_16816(acc[j], a0, a1, a2, a3, b[0], b[1]);
                    mma_bf16_16816(acc[j + 1], a0, a1, a2, a3, b[2], b[3]);
                }
            }
        }
        __syncthreads();
    }

    if (t < kQTile && q0 + t < pairs) {
        const int p = q0 + t;
        const int64_t e = part.entry(s, chunk, max_chunks, d.heads, kvh * group + p % group, d.block, p / group);
        part.ws[e] = row_m[t];
        part.ws[part.entries + e] = row_l[t];
    }
    const int r0 = 16 * (warp % 4), nt0 = (warp / 4) * kNT;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int p = q0 + r0 + g + 8 * h;
        if (p >= pairs) continue;
        const int64_t e = part.entry(s, chunk, max_chunks, d.heads, kvh * group + p % group, d.block, p / group);
        float* out = part.ws + 2 * part.entries + e * hd;
#pragma unroll
        for (int j = 0; j < kNT; ++j) {
            if (nt0 + j >= col_tiles) break;
            const int col = 8 * (nt0 + j) + 2 * tq;
            out[col] = acc[j][2 * h];
            out[col + 1] = acc[j][2 * h + 1];
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

template <int kNT>
cudaError_t launch_chunks(const bf16* q, const GqaKeys& keys, const GqaDims& d, float scale_log2, int streams,
                          int max_chunks, const Partials& part, cudaStream_t stream) {
    static std::atomic<uint64_t> configured{0};
    DDTREE_RETURN_IF_ERROR(
        opt_in_smem(gqa_chunk_kernel<kNT>, static_cast<int>(Smem::bytes(16 * kNT)), configured));
    const int pairs = d.block * (d.heads / d.kv_heads);
    const dim3 grid(max_chunks, d.kv_heads * ((pairs + kQTile - 1) / kQTile), streams);
    return launch_dependent(gqa_chunk_kernel<kNT>, grid, dim3(kThreads), Smem::bytes(d.head_dim), stream, q, keys,
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
        err = launch_chunks<2>(q, keys, d, scale_log2, streams, max_chunks, part, stream);
    } else if (d.head_dim <= 64) {
        err = launch_chunks<4>(q, keys, d, scale_log2, streams, max_chunks, part, stream);
    } else if (d.head_dim <= 128) {
        err = launch_chunks<8>(q, keys, d, scale_log2, streams, max_chunks, part, stream);
    } else {
        err = launch_chunks<16>(q, keys, d, scale_log2, streams, max_chunks, part, stream);
    }
    DDTREE_RETURN_IF_ERROR(err);
    return launch_dependent(gqa_merge_kernel, dim3(streams * d.block, d.heads), dim3(128), 0, stream, out, keys, d,
                            max_chunks, part);
}

}  // namespace ddtree::kernels

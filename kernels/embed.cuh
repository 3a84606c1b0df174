// Row gather: out[r] = table[ids[r]] for bf16 rows (token embedding, and picking the rows whose logits are
// needed). One CTA per output row; ids are validated at the boundary, so the kernel trusts them.
#pragma once
#include <cstdint>

#include "common.cuh"

namespace ddtree::kernels {

// table: [*, dim] with row stride `table_ld`; out: [rows, dim] with row stride `out_ld` (elements). dim,
// table_ld and out_ld must be multiples of 8 (16-byte copies).
cudaError_t gather_rows(bf16* out, int64_t out_ld, const bf16* table, int64_t table_ld, const int32_t* ids,
                        int rows, int dim, cudaStream_t stream);

}  // namespace ddtree::kernels

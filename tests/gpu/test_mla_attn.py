"""Absorbed-MLA attention over a latent cache against an fp32 torch reference; bitwise batch invariance; tree keys
read through the per-row indirection equal to the same keys stored contiguously."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
kernels = pytest.importorskip("ddtree._native", exc_type=ImportError).kernels

POISON = float("nan")


def _setup(heads: int, lora: int, rope: int, lengths: list[int], seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    rows, d = len(lengths), lora + rope
    cap = max(lengths)
    cache = torch.randn(rows * cap, d, device="cuda", generator=g).bfloat16()
    q = (torch.randn(rows, heads, d, device="cuda", generator=g) * 0.5).bfloat16()
    kv_start = torch.arange(rows, device="cuda", dtype=torch.int32) * cap
    kv_len = torch.tensor(lengths, device="cuda", dtype=torch.int32)
    return q, cache, kv_start, kv_len, cap


def _attend(q, cache, kv_start, kv_len, max_len, lora, scale, key_start=None, key_nodes=None):
    rows, heads = q.shape[:2]
    out = torch.full((rows, heads, lora), POISON, device="cuda", dtype=torch.bfloat16)
    ws = torch.full((kernels.mla_workspace_floats(heads, lora, q.shape[2] - lora, rows, max_len),), POISON,
                    device="cuda")
    kernels.mla_attention(out, q, cache, kv_start, kv_len, max_len, scale, ws, key_start, key_nodes)
    torch.cuda.synchronize()
    return out


def _reference(q, cache, kv_start, kv_len, lora, scale):
    outs = []
    for r in range(q.shape[0]):
        kv = cache[kv_start[r]:kv_start[r] + kv_len[r]].float()
        p = torch.softmax(q[r].float() @ kv.T * scale, dim=-1)
        outs.append(p @ kv[:, :lora])
    return torch.stack(outs)


@pytest.mark.parametrize("heads,lora,rope,lengths", [
    (64, 512, 64, [1, 31, 513, 1500]),   # K2 dims; lengths inside, at and across chunk boundaries
    (64, 512, 64, [8192]),
    (64, 512, 64, [32, 33, 64, 65, 95, 1023, 1024, 1057]),  # around 64-key tiles and 512-key chunks
    (64, 512, 64, [4096, 4097, 5121, 9000]),  # the last length of 512-key chunks, then 1024-key chunks
    (64, 512, 64, [2600, 3500, 13000]),  # 6, 7 and 13 chunks to merge
    (16, 512, 64, [2, 600]),            # fewer heads than one CTA's 64
    (4, 32, 16, [1, 2, 77]),             # tiny preset
    (8, 128, 32, [600, 1025, 3]),        # small preset
    (8, 128, 32, [4097, 6000]),          # small preset, 1024-key chunks
    (3, 128, 32, [1, 33]),               # odd head count
    (64, 32, 16, [5, 530]),             # a full head group at tiny dims
    (70, 512, 64, [40]),                 # heads beyond one CTA's 64
])
def test_mla_attention_matches_fp32(heads: int, lora: int, rope: int, lengths: list[int]) -> None:
    q, cache, kv_start, kv_len, cap = _setup(heads, lora, rope, lengths, len(lengths) + heads)
    scale = (128 + rope) ** -0.5
    out = _attend(q, cache, kv_start, kv_len, cap, lora, scale)
    ref = _reference(q, cache, kv_start, kv_len, lora, scale)
    # P is rounded to bf16 before P.V (as flash attention does): error ~ bf16 eps of the output magnitude
    torch.testing.assert_close(out.float(), ref, rtol=2**-6, atol=2**-7 * ref.abs().max().item())


@pytest.mark.parametrize("heads,lora,rope", [(64, 512, 64), (8, 128, 32), (4, 32, 16)])
def test_mla_attention_ignores_cache_rows_past_the_length(heads: int, lora: int, rope: int) -> None:
    """Tiles are copied whole: the rows after a row's last key (other positions, NaN here) must not leak in."""
    lengths = [1, 45, 531]
    q, cache, kv_start, kv_len, cap = _setup(heads, lora, rope, lengths, 7)
    for start, n in zip(kv_start.tolist(), lengths):
        cache[start + n:start + cap] = float("nan")
    scale = (128 + rope) ** -0.5
    out = _attend(q, cache, kv_start, kv_len, cap, lora, scale)
    ref = _reference(q, cache, kv_start, kv_len, lora, scale)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref, rtol=2**-6, atol=2**-7 * ref.abs().max().item())


@pytest.mark.parametrize("heads,lora,rope", [(64, 512, 64), (8, 128, 32), (4, 32, 16)])
def test_mla_attention_batch_invariant(heads: int, lora: int, rope: int) -> None:
    lengths = [700, 1, 3000, 513, 64, 2048, 9, 1200, 31, 6000, 1600, 2, 4000, 4097, 512, 1024]
    q, cache, kv_start, kv_len, cap = _setup(heads, lora, rope, lengths, 3)
    scale = (128 + rope) ** -0.5
    full = _attend(q, cache, kv_start, kv_len, cap, lora, scale)
    # At K2 dims a launch of few chunk CTAs splits the latent columns over 2 or 4 CTAs: on 128-255 SMs (an H200
    # has 132) 16 rows launched for 8 chunks each (the most any row of up to 6000 keys has: 4096 keys in 512-key
    # chunks) run unsplit, 8 rows in two slices, one row in four; each row's bits must not change.
    half = _attend(q[:8].contiguous(), cache, kv_start[:8].contiguous(), kv_len[:8].contiguous(), cap, lora, scale)
    assert torch.equal(half, full[:8])
    for r in (0, 2, 9, 13, 15):
        alone = _attend(q[r:r + 1].contiguous(), cache, kv_start[r:r + 1].contiguous(), kv_len[r:r + 1].contiguous(),
                        cap, lora, scale)
        assert torch.equal(alone, full[r:r + 1]), r
    # the max_len bound of the launch (how many chunk CTAs exist) does not change a row either, on either side of
    # the chunk-size switch (a chunk size taken from the bound instead of the row would show here)
    wider = _attend(q[:1].contiguous(), cache, kv_start[:1].contiguous(), kv_len[:1].contiguous(), 2 * cap, lora,
                    scale)
    assert torch.equal(wider, full[:1])
    for r in (12, 13):  # 4000 and 4097 keys, each launched bounded by its own length
        own = _attend(q[r:r + 1].contiguous(), cache, kv_start[r:r + 1].contiguous(), kv_len[r:r + 1].contiguous(),
                      lengths[r], lora, scale)
        assert torch.equal(own, full[r:r + 1]), r
    assert torch.equal(_attend(q, cache, kv_start, kv_len, 16384, lora, scale), full)
    # nor do the other rows' positions: the same rows beside neighbours of other lengths and cache offsets
    shifted = torch.roll(torch.arange(len(lengths), device="cuda"), 5)
    other = _attend(q[shifted].contiguous(), cache, kv_start[shifted].contiguous(), kv_len[shifted].contiguous(),
                    cap, lora, scale)
    assert torch.equal(other, full[shifted])


def test_mla_attention_names_a_short_workspace() -> None:
    q, cache, kv_start, kv_len, cap = _setup(64, 512, 64, [600], 1)
    out = torch.empty(1, 64, 512, device="cuda", dtype=torch.bfloat16)
    floats = kernels.mla_workspace_floats(64, 512, 64, 1, cap)
    ws = torch.empty(floats, device="cuda")
    with pytest.raises(ValueError, match="workspace"):
        kernels.mla_attention(out, q, cache, kv_start, kv_len, cap, 0.1, ws[:-1])
    with pytest.raises(ValueError, match="workspace"):  # made as fp16, not converted: no read of unwritten memory
        kernels.mla_attention(out, q, cache, kv_start, kv_len, cap, 0.1,
                              torch.empty(floats, device="cuda", dtype=torch.float16))


def _random_tree(rng: np.random.Generator, nodes: int) -> tuple[list[int], list[int]]:
    """Parents (parent < child, root 0) and depths of a random tree of `nodes` rows."""
    parents, depths = [-1], [0]
    for i in range(1, nodes):
        parents.append(int(rng.integers(0, i)) if rng.random() < 0.7 else i - 1)
        depths.append(depths[parents[-1]] + 1)
    return parents, depths


@pytest.mark.parametrize("heads,lora,rope,start,nodes", [
    (64, 512, 64, 500, 33),    # paths across the 512-key chunk edge and a 64-key tile edge
    (64, 512, 64, 4090, 24),   # rows on both sides of the switch to 1024-key chunks
    (64, 512, 64, 1, 9),       # a prefix of one key
    (8, 128, 32, 60, 256),     # deep paths over several tiles
    (4, 32, 16, 1000, 65),
])
def test_tree_keys_equal_contiguous_path(heads: int, lora: int, rope: int, start: int, nodes: int) -> None:
    """Node i at depth d reads the prefix and its ancestors through key_nodes from the node slots after the prefix;
    it must get exactly the output of a row whose cache holds the same keys contiguously (an autoregressive row of
    its path). Plain rows in the same launch (key_start past their length) keep their contiguous keys."""
    rng = np.random.default_rng(start + nodes)
    parents, depths = _random_tree(rng, nodes)
    d = lora + rope
    g = torch.Generator(device="cuda").manual_seed(nodes)
    tree_cache = torch.randn(start + nodes, d, device="cuda", generator=g).bfloat16()
    q = (torch.randn(nodes + 2, heads, d, device="cuda", generator=g) * 0.5).bfloat16()
    stride = max(depths) + 1
    ancestors = np.full((nodes + 2, stride), -1, dtype=np.int32)
    cap = start + stride
    path_cache = torch.full((nodes * cap, d), float("nan"), device="cuda", dtype=torch.bfloat16)
    for i in range(nodes):
        chain, node = [], i
        while node >= 0:
            chain.append(node)
            node = parents[node]
        chain.reverse()
        ancestors[i, :len(chain)] = chain
        path_cache[i * cap:i * cap + start] = tree_cache[:start]
        path_cache[i * cap + start:i * cap + start + len(chain)] = tree_cache[start + torch.tensor(chain)]
    lengths = [start + dep + 1 for dep in depths]
    # two plain rows of the tree's stream: the whole prefix, and prefix + the first node slots as they lie
    kv_len = torch.tensor(lengths + [start, start + 3], device="cuda", dtype=torch.int32)
    kv_start = torch.zeros(nodes + 2, device="cuda", dtype=torch.int32)
    key_start = torch.tensor([start] * nodes + [start, start + 3], device="cuda", dtype=torch.int32)
    scale = (128 + rope) ** -0.5
    max_len = start + stride
    out = _attend(q, tree_cache, kv_start, kv_len, max_len, lora, scale, key_start,
                  torch.from_numpy(ancestors).cuda())
    contiguous = _attend(q[:nodes].contiguous(), path_cache, torch.arange(nodes, device="cuda", dtype=torch.int32) * cap,
                         kv_len[:nodes].contiguous(), max_len, lora, scale)
    assert torch.equal(out[:nodes], contiguous)
    plain = _attend(q[nodes:].contiguous(), tree_cache, kv_start[nodes:].contiguous(), kv_len[nodes:].contiguous(),
                    max_len, lora, scale)
    assert torch.equal(out[nodes:], plain)
    ref = _reference(q[:nodes], path_cache, torch.arange(nodes) * cap, kv_len[:nodes].cpu(), lora, scale)
    torch.testing.assert_close(out[:nodes].float(), ref, rtol=2**-6, atol=2**-7 * ref.abs().max().item())

"""The demo DFlash drafter in torch, for training only: ddtree.reference.drafter's math, batched over many anchors.

One reference draft call sees the tapped target hidden states of positions [0, anchor) as context (fc, then
hidden_norm; every layer projects that same context to its K/V) and the block [token at anchor, MASK x (B - 1)] at
positions anchor .. anchor + B - 1, attending to the context and bidirectionally within the block. Training puts
many anchors of one sequence into one forward: the context K/V are computed once for the whole sequence, and a
mask lets each block see the context rows before its anchor and its own rows only. RoPE is the rotate-half layout
over the whole head_dim with DrafterConfig.rope_attention_factor as amplitude (Rope.from_drafter_config); the
softmax scale is head_dim^-0.5; the embedding and the LM head are the target's, frozen.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ddtree import bf16
from ddtree.drafter import DrafterConfig
from ddtree.reference.rope import Rope

from demo_target import rms_norm


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, n, d] with pairs (i, i + d/2); cos/sin [b, 1, n, d / 2] already times the amplitude."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


def _linear(out_dim: int, in_dim: int) -> nn.Parameter:
    return nn.Parameter(torch.randn(out_dim, in_dim) * in_dim**-0.5)


class DraftLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        self.input_layernorm = nn.Parameter(torch.ones(h))
        self.post_attention_layernorm = nn.Parameter(torch.ones(h))
        self.q_proj = _linear(cfg.num_attention_heads * hd, h)
        self.k_proj = _linear(cfg.num_key_value_heads * hd, h)
        self.v_proj = _linear(cfg.num_key_value_heads * hd, h)
        self.o_proj = _linear(h, cfg.num_attention_heads * hd)
        self.q_norm = nn.Parameter(torch.ones(hd))
        self.k_norm = nn.Parameter(torch.ones(hd))
        self.gate_proj, self.up_proj = _linear(cfg.intermediate_size, h), _linear(cfg.intermediate_size, h)
        self.down_proj = _linear(h, cfg.intermediate_size)

    def _heads(self, x: torch.Tensor, weight: torch.Tensor, heads: int) -> torch.Tensor:
        b, n, _ = x.shape
        return F.linear(x, weight).view(b, n, heads, self.cfg.head_dim).transpose(1, 2)

    def _kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cfg
        k = rms_norm(self._heads(x, self.k_proj, c.num_key_value_heads), self.k_norm, c.rms_norm_eps)
        return rotate_half(k, cos, sin), self._heads(x, self.v_proj, c.num_key_value_heads)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, ctx_rope: tuple[torch.Tensor, torch.Tensor],
                block_rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        b, n, _ = x.shape
        h = rms_norm(x, self.input_layernorm, c.rms_norm_eps)
        q = rotate_half(rms_norm(self._heads(h, self.q_proj, c.num_attention_heads), self.q_norm, c.rms_norm_eps),
                        *block_rope)
        k_ctx, v_ctx = self._kv(ctx, *ctx_rope)
        k_blk, v_blk = self._kv(h, *block_rope)
        group = c.num_attention_heads // c.num_key_value_heads  # query head i reads kv head i // group
        keys = torch.cat([k_ctx, k_blk], dim=2).repeat_interleave(group, dim=1)
        values = torch.cat([v_ctx, v_blk], dim=2).repeat_interleave(group, dim=1)
        q, keys, values = (t.to(values.dtype) for t in (q, keys, values))
        attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=c.head_dim**-0.5)
        x = x + F.linear(attn.transpose(1, 2).reshape(b, n, -1), self.o_proj)
        h = rms_norm(x, self.post_attention_layernorm, c.rms_norm_eps)
        return x + F.linear(F.silu(F.linear(h, self.gate_proj)) * F.linear(h, self.up_proj), self.down_proj)


class Drafter(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.cfg = cfg
        rope = Rope.from_drafter_config(cfg)
        self.register_buffer("inv_freq", torch.from_numpy(rope.inv_freq.copy()), persistent=False)
        self.amplitude = float(rope.attention_factor)
        self.fc = _linear(cfg.hidden_size, cfg.context_width)
        self.hidden_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.float()[:, None, :, None] * self.inv_freq  # [b, 1, n, d / 2]
        return torch.cos(angles) * self.amplitude, torch.sin(angles) * self.amplitude

    def forward(self, context: torch.Tensor, ids: torch.Tensor, anchors: torch.Tensor, embed: torch.Tensor,
                lm_head: torch.Tensor) -> torch.Tensor:
        """Per-depth logits [b, anchors, B - 1, vocab] of the blocks at `anchors` [b, a] (each in [1, n - B]) of
        sequences ids [b, n] whose tapped target hidden states (concatenated in target_layer_ids order) are
        context [b, n, taps * hidden]."""
        c, (b, n) = self.cfg, ids.shape
        block = c.block_size
        offsets = torch.arange(block, device=ids.device)
        block_pos = (anchors[..., None] + offsets).flatten(1)  # [b, a * B]
        block_ids = torch.full_like(block_pos, c.mask_token_id)
        block_ids[:, ::block] = torch.gather(ids, 1, anchors)
        x = F.embedding(block_ids, embed)
        ctx = rms_norm(F.linear(context, self.fc), self.hidden_norm, c.rms_norm_eps)
        ctx_pos = torch.arange(n, device=ids.device).expand(b, n)
        # Block row r (of anchor r // B) sees context rows before its anchor and the rows of its own block.
        row_anchor = block_pos - torch.arange(block_pos.shape[1], device=ids.device) % block
        sees_ctx = ctx_pos[:, None, :] < row_anchor[:, :, None]
        block_of = torch.arange(block_pos.shape[1], device=ids.device) // block
        sees_block = (block_of[:, None] == block_of[None, :]).expand(b, -1, -1)
        mask = torch.cat([sees_ctx, sees_block], dim=2)[:, None]
        ctx_rope, block_rope = self._rope(ctx_pos), self._rope(block_pos)
        for layer in self.layers:
            x = layer(x, ctx, ctx_rope, block_rope, mask)
        x = x.view(b, -1, block, c.hidden_size)[:, :, 1:]
        return F.linear(rms_norm(x, self.norm, c.rms_norm_eps), lm_head)

    def _checkpoint_names(self) -> dict[str, nn.Parameter]:
        """Checkpoint tensor name -> parameter (ddtree.drafter.drafter_tensor_specs's names)."""
        names = {}
        for name, tensor in self.named_parameters():
            prefix, _, leaf = name.rpartition(".")
            if leaf in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
                name = f"{prefix}.self_attn.{leaf}"
            elif leaf in ("gate_proj", "up_proj", "down_proj"):
                name = f"{prefix}.mlp.{leaf}"
            names[f"{name}.weight"] = tensor
        return names

    def checkpoint_tensors(self) -> dict[str, np.ndarray]:
        return {name: bf16.from_float32(t.detach().float().cpu().numpy())
                for name, t in self._checkpoint_names().items()}

    @torch.no_grad()
    def load_checkpoint_tensors(self, tensors) -> None:
        for name, tensor in self._checkpoint_names().items():
            tensor.copy_(torch.from_numpy(bf16.as_float32(tensors[name]).copy()))

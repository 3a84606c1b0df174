"""The demo target in torch, for training only: the math of ddtree.reference (model, mla, moe, rope) term for term,
so the exported checkpoint generates on the reference and the engine as it trained.

What has to agree with the reference, and how it is kept so:
- RoPE frequencies, the cos/sin amplitude and the softmax scale are taken from ddtree's own Rope and ModelConfig;
  the rotation is the interleaved layout (dims 2i, 2i + 1) of DeepSeek checkpoints.
- RMSNorm eps: config.rms_norm_eps for the layer norms and the final norm, LORA_NORM_EPS for q_a/kv_a.
- Routing: sigmoid scores; the correction bias only ranks (top-k of score + bias); weights are the unbiased
  scores normalised over the top-k, times routed_scaling_factor. The bias is not learnt by gradient but moved
  after each step towards equal expert load (DeepSeek-V3's auxiliary-loss-free balancing).
- Routed experts are INT4 group-32 in the checkpoint: with `fake_quant` on, every forward uses the weights
  ddtree.reference.int4 would dequantize (absmax / 7 bf16 scales, round half to even, clip to [-8, 7]), with a
  straight-through gradient (quantization-aware training).
All routed experts are computed for every token and weighted by zero where not chosen: at this size that is
faster than gathering tokens per expert, and it gives the same output and gradients as top-k routing.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ddtree import bf16
from ddtree.config import LORA_NORM_EPS, ModelConfig
from ddtree.reference import int4
from ddtree.reference.rope import Rope

BIAS_UPDATE_RATE = 1e-3  # DeepSeek-V3's gamma for the routing-bias update


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (weight.float() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., L, d] with pairs (2i, 2i + 1); cos/sin [L, d / 2] already times the attention factor."""
    first, second = x[..., 0::2], x[..., 1::2]
    return torch.stack((first * cos - second * sin, second * cos + first * sin), dim=-1).flatten(-2)


def fake_int4(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """w [..., out, in] as the dequantized INT4 weights of ddtree.reference.int4, gradient passed straight through."""
    groups = w.float().unflatten(-1, (-1, group_size))
    absmax = groups.abs().amax(-1, keepdim=True)
    scale = torch.where(absmax > 0, absmax / int4.MAX_CODE, torch.ones_like(absmax)).bfloat16().float()
    codes = torch.clamp(torch.round(groups / scale), -int4.CODE_OFFSET, int4.MAX_CODE)
    quantized = (codes * scale).flatten(-2).to(w.dtype)
    return w + (quantized - w).detach()


def _linear(out_dim: int, in_dim: int) -> nn.Parameter:
    return nn.Parameter(torch.randn(out_dim, in_dim) * in_dim**-0.5)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, heads = cfg.hidden_size, cfg.num_attention_heads
        self.q_a_proj = _linear(cfg.q_lora_rank, h)
        self.q_a_layernorm = nn.Parameter(torch.ones(cfg.q_lora_rank))
        self.q_b_proj = _linear(heads * cfg.qk_head_dim, cfg.q_lora_rank)
        self.kv_a_proj_with_mqa = _linear(cfg.kv_lora_rank + cfg.qk_rope_head_dim, h)
        self.kv_a_layernorm = nn.Parameter(torch.ones(cfg.kv_lora_rank))
        self.kv_b_proj = _linear(heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
        self.o_proj = _linear(h, heads * cfg.v_head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        b, n, _ = x.shape
        heads, nope, rope, v_dim = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        q = F.linear(rms_norm(F.linear(x, self.q_a_proj), self.q_a_layernorm, LORA_NORM_EPS), self.q_b_proj)
        q = q.view(b, n, heads, nope + rope).transpose(1, 2)
        compressed = F.linear(x, self.kv_a_proj_with_mqa)
        latent = rms_norm(compressed[..., :c.kv_lora_rank], self.kv_a_layernorm, LORA_NORM_EPS)
        k_rope = rotate_interleaved(compressed[..., c.kv_lora_rank:], cos, sin)[:, None]  # [b, 1, n, rope]
        kv = F.linear(latent, self.kv_b_proj).view(b, n, heads, nope + v_dim).transpose(1, 2)
        q = torch.cat([q[..., :nope], rotate_interleaved(q[..., nope:], cos, sin)], dim=-1)
        k = torch.cat([kv[..., :nope], k_rope.expand(b, heads, n, rope)], dim=-1)
        out = F.scaled_dot_product_attention(q, k, kv[..., nope:], is_causal=True, scale=c.softmax_scale)
        return F.linear(out.transpose(1, 2).reshape(b, n, heads * v_dim), self.o_proj)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = _linear(inter, hidden), _linear(inter, hidden), \
            _linear(hidden, inter)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.silu(F.linear(x, self.gate_proj)) * F.linear(x, self.up_proj), self.down_proj)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        e, h, inter = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate = _linear(e, h)
        self.register_buffer("e_score_correction_bias", torch.zeros(e))
        self.gate_proj = nn.Parameter(torch.randn(e, inter, h) * h**-0.5)
        self.up_proj = nn.Parameter(torch.randn(e, inter, h) * h**-0.5)
        self.down_proj = nn.Parameter(torch.randn(e, h, inter) * inter**-0.5)
        self.shared_experts = SwiGLU(h, cfg.n_shared_experts * inter)
        self.fake_quant = False
        self.load = torch.zeros(e)  # tokens routed to each expert in the last forward

    def combine_weights(self, x: torch.Tensor) -> torch.Tensor:
        """[tokens, experts] combine weights, zero where an expert is not chosen."""
        with torch.autocast(x.device.type, enabled=False):  # routing in float32, as the reference routes
            return self._combine_weights(x.float())

    def _combine_weights(self, x: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        scores = torch.sigmoid(F.linear(x, self.gate))
        chosen = torch.topk(scores + self.e_score_correction_bias, c.num_experts_per_tok, dim=-1).indices
        picked = torch.gather(scores, -1, chosen)
        if c.norm_topk_prob:
            picked = picked / (picked.sum(-1, keepdim=True) + 1e-20)
        self.load = torch.bincount(chosen.flatten(), minlength=c.n_routed_experts).detach()
        return torch.zeros_like(scores).scatter(-1, chosen, picked * c.routed_scaling_factor)

    def experts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        weights = (self.gate_proj, self.up_proj, self.down_proj)
        g = self.cfg.quantization.group_size
        return tuple(fake_int4(w, g) for w in weights) if self.fake_quant else weights  # type: ignore[return-value]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights = self.combine_weights(flat).to(flat.dtype)
        gate, up, down = self.experts()
        act = F.silu(torch.einsum("nh,eih->nei", flat, gate)) * torch.einsum("nh,eih->nei", flat, up)
        routed = torch.einsum("nei,ehi->nh", act * weights[..., None], down)
        return (routed + self.shared_experts(flat)).view_as(x)

    @torch.no_grad()
    def balance(self) -> None:
        """Raise the bias of under-loaded experts and lower that of over-loaded ones, by a fixed step."""
        load = self.load.float()
        self.e_score_correction_bias += BIAS_UPDATE_RATE * torch.sign(load.mean() - load)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.input_layernorm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.post_attention_layernorm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.self_attn = Attention(cfg)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(layer) else SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.self_attn(rms_norm(x, self.input_layernorm, self.eps), cos, sin)
        return h + self.mlp(rms_norm(h, self.post_attention_layernorm, self.eps))


class Target(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        rope = Rope.from_config(cfg)
        self.register_buffer("inv_freq", torch.from_numpy(rope.inv_freq.copy()), persistent=False)
        self.attention_factor = float(rope.attention_factor)
        self.embed_tokens = nn.Parameter(torch.randn(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = _linear(cfg.vocab_size, cfg.hidden_size)

    def moe_layers(self) -> list[MoE]:
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, MoE)]

    def set_fake_quant(self, on: bool) -> None:
        for moe in self.moe_layers():
            moe.fake_quant = on

    def cos_sin(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        angles = torch.arange(length, device=self.inv_freq.device, dtype=torch.float32)[:, None] * self.inv_freq
        return torch.cos(angles) * self.attention_factor, torch.sin(angles) * self.attention_factor

    def forward(self, ids: torch.Tensor, taps: tuple[int, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Logits [b, n, vocab] of ids [b, n] at positions 0..n-1, and the residual stream after each layer in
        `taps` (the reference's ForwardOutput.hidden)."""
        cos, sin = self.cos_sin(ids.shape[1])
        x = F.embedding(ids, self.embed_tokens)  # the residual stream stays float32 under autocast
        tapped = []
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin)
            if i in taps:
                tapped.append(x)
        return F.linear(rms_norm(x, self.norm, self.cfg.rms_norm_eps), self.lm_head), tapped

    @torch.no_grad()
    def round_to_bf16(self, experts: bool) -> None:
        """Parameters rounded to the bf16 the checkpoint stores; the routed experts too only when `experts` (INT4
        export quantizes them from the float32 values that quantization-aware training saw)."""
        routed = {id(w) for moe in self.moe_layers() for w in (moe.gate_proj, moe.up_proj, moe.down_proj)}
        for p in self.parameters():
            if experts or id(p) not in routed:
                p.copy_(p.bfloat16().float())

    def _checkpoint_names(self) -> dict[str, tuple[torch.Tensor, int | None]]:
        """Checkpoint tensor name (without the INT4 suffixes of routed experts) -> (parameter or buffer, the
        expert's index in its stacked parameter, or None)."""
        names: dict[str, tuple[torch.Tensor, int | None]] = {
            "model.embed_tokens.weight": (self.embed_tokens, None), "model.norm.weight": (self.norm, None),
            "lm_head.weight": (self.lm_head, None)}
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}"
            names[f"{p}.input_layernorm.weight"] = (layer.input_layernorm, None)
            names[f"{p}.post_attention_layernorm.weight"] = (layer.post_attention_layernorm, None)
            for name, tensor in layer.self_attn.named_parameters():
                names[f"{p}.self_attn.{name}.weight"] = (tensor, None)
            mlp = layer.mlp
            if isinstance(mlp, SwiGLU):
                for name, tensor in mlp.named_parameters():
                    names[f"{p}.mlp.{name}.weight"] = (tensor, None)
                continue
            names[f"{p}.mlp.gate.weight"] = (mlp.gate, None)
            names[f"{p}.mlp.gate.e_score_correction_bias"] = (mlp.e_score_correction_bias, None)
            for name, tensor in mlp.shared_experts.named_parameters():
                names[f"{p}.mlp.shared_experts.{name}.weight"] = (tensor, None)
            for name in ("gate_proj", "up_proj", "down_proj"):
                for e in range(self.cfg.n_routed_experts):
                    names[f"{p}.mlp.experts.{e}.{name}"] = (getattr(mlp, name), e)
        return names

    def checkpoint_tensors(self) -> dict[str, np.ndarray]:
        """The tensors of ddtree.checkpoint.expected_tensors(cfg): bf16 bits, INT4 experts quantized from the
        float32 weights, the float32 routing biases."""
        out = {}
        for name, (tensor, expert) in self._checkpoint_names().items():
            values = tensor.detach().float().cpu().numpy()
            if expert is not None:
                for field, value in int4.quantize_linear(values[expert], self.cfg.quantization.group_size).items():
                    out[f"{name}.{field}"] = value
            elif name.endswith("e_score_correction_bias"):
                out[name] = values
            else:
                out[name] = bf16.from_float32(values)
        return out

    @torch.no_grad()
    def load_checkpoint_tensors(self, tensors) -> None:
        """The weights a checkpoint holds, routed experts dequantized (run with fake_quant off)."""
        for name, (tensor, expert) in self._checkpoint_names().items():
            if expert is None:
                tensor.copy_(torch.from_numpy(bf16.as_float32(tensors[name]).copy()))
            else:
                w = int4.dequantize(tensors[f"{name}.weight_packed"], tensors[f"{name}.weight_scale"])
                tensor[expert].copy_(torch.from_numpy(w))

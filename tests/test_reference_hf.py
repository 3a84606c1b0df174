"""The numpy reference against an implementation nobody here wrote: HF transformers' DeepseekV3ForCausalLM.

On the tiny preset, HF runs in fp32 on CPU with the routed experts dequantized by this test's own torch unpacking of
the compressed-tensors format, built from the config.json our writer produced.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from ddtree.checkpoint import open_checkpoint, write_checkpoint
from ddtree.presets import make_model, preset_config, random_tensors
from ddtree.reference import ReferenceModel

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPTS = ([1, 2, 3], [5, 100, 7, 300, 42, 9, 8], [0], [511, 17, 17, 17, 256, 3, 64, 200, 13, 77, 401])
GREEDY_TOKENS = 32
LOGIT_RTOL = 1e-4


def _bf16(array: np.ndarray) -> torch.Tensor:
    """uint16 bf16 bit patterns -> fp32 tensor, via torch's own bfloat16."""
    return torch.from_numpy(array.astype(np.int16)).view(torch.bfloat16).float()


def _dequantize(packed: np.ndarray, scale: np.ndarray) -> torch.Tensor:
    """compressed-tensors pack-quantized: nibble i of word j is input 8j+i, value (nibble - 8) * scale."""
    words = torch.from_numpy(packed.astype(np.int64)) & 0xFFFFFFFF
    nibbles = (words.unsqueeze(-1) >> (4 * torch.arange(8))) & 0xF
    codes = nibbles.reshape(packed.shape[0], -1).float() - 8
    scales = _bf16(scale)
    return codes * scales.repeat_interleave(codes.shape[1] // scales.shape[1], dim=1)


def _hf_state_dict(weights, cfg) -> dict[str, torch.Tensor]:
    state = {}
    for name in weights:
        if ".mlp.experts." in name:
            continue
        array = np.asarray(weights[name])
        state[name] = _bf16(array) if array.dtype == np.uint16 else torch.from_numpy(array.astype(np.float32))
    for layer in range(cfg.first_k_dense_replace, cfg.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp.experts"
        gate_up, down = [], []
        for e in range(cfg.n_routed_experts):
            w = {p: _dequantize(weights[f"{prefix}.{e}.{p}.weight_packed"], weights[f"{prefix}.{e}.{p}.weight_scale"])
                 for p in ("gate_proj", "up_proj", "down_proj")}
            gate_up.append(torch.cat([w["gate_proj"], w["up_proj"]]))
            down.append(w["down_proj"])
        state[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
        state[f"{prefix}.down_proj"] = torch.stack(down)
    return state


def _build(model_dir):
    """Our reference and HF's model over the checkpoint in model_dir, HF configured from its config.json."""
    checkpoint = open_checkpoint(model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    for key in ("quantization_config", "architectures", "model_type", "torch_dtype"):
        raw.pop(key)
    hf_config = transformers.DeepseekV3Config(**raw, attn_implementation="eager", experts_implementation="eager")
    hf = transformers.DeepseekV3ForCausalLM(hf_config).float().eval()
    missing, unexpected = hf.load_state_dict(_hf_state_dict(checkpoint, checkpoint.config), strict=False)
    assert not unexpected and not missing, (missing, unexpected)
    return ReferenceModel(checkpoint.config, checkpoint), hf


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("tiny")
    make_model("tiny", model_dir, seed=3)
    return _build(model_dir)


@pytest.fixture(scope="module")
def rotate_half_models(tmp_path_factory):
    """The tiny preset with rope_interleave false: rope pairs are (i, i + d/2) instead of (2i, 2i + 1)."""
    model_dir = tmp_path_factory.mktemp("tiny_rotate_half")
    cfg = dataclasses.replace(preset_config("tiny"), rope_interleave=False)
    write_checkpoint(model_dir, cfg, random_tensors(cfg, seed=4))
    return _build(model_dir)


def _rel_err(ours: np.ndarray, theirs: np.ndarray) -> float:
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


@pytest.mark.parametrize("prompt", PROMPTS)
def test_logits_and_hidden_states_match(models, prompt):
    _check_logits_and_hidden_states(*models, prompt)


@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_rotate_half_layout_matches(rotate_half_models, prompt):
    _check_logits_and_hidden_states(*rotate_half_models, prompt)


def _check_logits_and_hidden_states(ref, hf, prompt):
    layers = range(ref.config.num_hidden_layers)
    out = ref.forward(prompt, np.arange(len(prompt)), ref.new_cache(), hidden_layers=layers)
    with torch.no_grad():
        theirs = hf(torch.tensor([prompt]), output_hidden_states=True)
    assert _rel_err(out.logits, theirs.logits[0].numpy()) <= LOGIT_RTOL
    # HF's hidden_states[i + 1] is the residual stream after layer i (its last entry after the final norm).
    for layer in layers[:-1]:
        assert _rel_err(out.hidden[layer], theirs.hidden_states[layer + 1][0].numpy()) <= LOGIT_RTOL


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_continuation_matches(models, prompt):
    ref, hf = models
    ours = ref.greedy_generate(prompt, GREEDY_TOKENS)
    with torch.no_grad():
        ids = torch.tensor([prompt])
        theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=GREEDY_TOKENS, min_new_tokens=GREEDY_TOKENS,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    assert ours == theirs[0, len(prompt):].tolist()


def test_tree_mask_and_positions_match(models):
    """A DDTree verify: tree nodes after a prefix, each seeing the prefix and its ancestors, at start + depth."""
    ref, hf = models
    prefix = [7, 300, 42, 9, 8]
    nodes = [11, 12, 13, 14, 15, 16]
    parents = [-1, 0, 0, 1, 3, 2]  # node 0 is the root (the bonus token); parents precede children
    depth = np.zeros(len(nodes), dtype=np.int64)
    visible = np.eye(len(nodes), dtype=bool)
    for i, p in enumerate(parents):
        if p >= 0:
            depth[i] = depth[p] + 1
            visible[i] |= visible[p]
    positions = len(prefix) + depth

    cache = ref.new_cache()
    ref.forward(prefix, np.arange(len(prefix)), cache)
    ours = ref.forward(nodes, positions, cache, visible=visible).logits

    total = len(prefix) + len(nodes)
    allowed = np.tril(np.ones((total, total), dtype=bool))
    allowed[len(prefix):, len(prefix):] = visible
    mask = torch.zeros(1, 1, total, total).masked_fill(torch.from_numpy(~allowed), float("-inf"))
    ids = torch.tensor([prefix + nodes])
    position_ids = torch.from_numpy(np.concatenate([np.arange(len(prefix)), positions]))[None]
    with torch.no_grad():
        theirs = hf(ids, attention_mask=mask, position_ids=position_ids).logits[0, len(prefix):].numpy()
    assert _rel_err(ours, theirs) <= LOGIT_RTOL
    # The mask matters: causal attention over the same nodes gives different logits.
    cache = ref.new_cache()
    ref.forward(prefix, np.arange(len(prefix)), cache)
    causal = ref.forward(nodes, positions, cache).logits
    assert _rel_err(causal, theirs) > 1e-2

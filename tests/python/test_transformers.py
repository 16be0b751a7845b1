"""The transformers integration: registration, a stock Llama built from a config, and a small model
in the style of upstream's Doge example (bias = A * softplus(dt_proj(V))), all randomly initialized
(nothing is downloaded). Each runs forward and backward through "dmattn" and through eager
attention; outputs and gradients must meet the rule of tolerance.py against a float32 eager run.

Skipped without torch or transformers. Runs on CPU tensors, and on CUDA where there is a GPU.
"""
import copy
from dataclasses import dataclass
from typing import Optional

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from transformers import AttentionInterface, AutoModelForCausalLM, LlamaConfig  # noqa: E402
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402

from flash_dmattn import attention_reference, create_mask, topk_key_indices  # noqa: E402
from flash_dmattn.integrations.transformers import flash_dmattn_attention_forward, register  # noqa: E402
from tolerance import assert_rounded, assert_within_baseline  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
NAME = register()


def test_registration():
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    assert NAME == "dmattn"
    assert ALL_ATTENTION_FUNCTIONS[NAME] is flash_dmattn_attention_forward
    assert ALL_MASK_ATTENTION_FUNCTIONS[NAME] is ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]
    assert isinstance(ALL_ATTENTION_FUNCTIONS, AttentionInterface)


def three_runs(make_model, run, device):
    """run() on a float32 eager model (reference), a bfloat16 eager one (baseline) and a bfloat16
    "dmattn" one, all with the same weights: {kind: (output, {parameter name: gradient})}."""
    torch.manual_seed(0)
    reference = make_model("eager").to(device)
    results = {}
    for kind, implementation, dtype in (("reference", "eager", torch.float32), ("baseline", "eager", torch.bfloat16),
                                        ("flash", NAME, torch.bfloat16)):
        model = make_model(implementation).to(device)
        model.load_state_dict(reference.state_dict())
        model.to(dtype)
        output = run(model)
        output.float().pow(2).mean().backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        results[kind] = (output, grads)
    return results


def check(results, names):
    out, grads = results["flash"]
    assert_within_baseline("output", out, results["reference"][0], results["baseline"][0])
    for name in names:
        assert_within_baseline(name, grads[name], results["reference"][1][name], results["baseline"][1][name])


# ------------------------------------------------------------------------------------------------
# A stock model: transformers builds the masks (padding here), the model calls the registered function


@pytest.mark.parametrize("device", DEVICES)
def test_llama_from_config(device):
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1)).to(device)
    padding = torch.ones(2, 24, dtype=torch.long, device=device)
    padding[1, :5] = 0  # left padding

    def make(implementation):  # a config each: from_config writes the implementation into it
        return AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=implementation)

    def run(model):
        logits = model(input_ids=ids, attention_mask=padding).logits
        return torch.cat([logits[0], logits[1, 5:]])  # padded positions carry no meaning

    check(three_runs(make, run, device),
          ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.v_proj.weight",
           "model.layers.1.self_attn.k_proj.weight"])


# ------------------------------------------------------------------------------------------------
# A model with a dynamic-mask bias, as in upstream's Doge example


@dataclass
class DynamicMaskConfig:
    vocab_size: int = 128
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    num_hidden_layers: int = 2
    window_size: Optional[int] = None
    attn_implementation: str = "eager"


def eager_attention(module, query, key, value, attention_mask, attention_bias=None, scaling=None, **kwargs):
    """The model's own eager path: (B, H, S, D) inputs, bias added, bool mask, causal, fp32 softmax."""
    heads, seqlen_q, seqlen_k = query.shape[1], query.shape[2], key.shape[2]
    key, value = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (key, value))
    scores = query @ key.transpose(-1, -2) * scaling
    if attention_bias is not None:
        scores = scores + attention_bias.repeat_interleave(heads // attention_bias.shape[1], dim=1)
    rows = torch.arange(seqlen_q, device=query.device)[:, None]
    visible = torch.arange(seqlen_k, device=query.device)[None, :] <= rows + seqlen_k - seqlen_q
    if attention_mask is not None:
        visible = visible & attention_mask
    scores = scores.masked_fill(~visible, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return (probs @ value).transpose(1, 2), probs


class DynamicMaskAttention(nn.Module):
    def __init__(self, config: DynamicMaskConfig):
        super().__init__()
        self.config = config
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scaling = self.head_dim ** -0.5
        self.is_causal = True
        self.window_size = config.window_size
        self.q_proj = nn.Linear(config.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=False)
        self.dt_proj = nn.Linear(self.kv_heads * self.head_dim, self.kv_heads, bias=False)
        self.A = nn.Parameter(torch.randn(self.kv_heads))  # upstream starts from zeros: a bias of 0

    def forward(self, hidden, attention_mask=None):
        batch, seqlen, _ = hidden.shape
        q = self.q_proj(hidden).view(batch, seqlen, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden).view(batch, seqlen, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden).view(batch, seqlen, self.kv_heads, self.head_dim).transpose(1, 2)
        dt = self.dt_proj(v.transpose(1, 2).reshape(batch, seqlen, -1))             # (B, S, Hk)
        bias = (self.A * F.softplus(dt)).transpose(-1, -2).unsqueeze(-2)          # (B, Hk, 1, S)
        implementation = self.config.attn_implementation
        attention = eager_attention if implementation == "eager" else ALL_ATTENTION_FUNCTIONS[implementation]
        out, _ = attention(self, q, k, v, attention_mask, attention_bias=bias, scaling=self.scaling)
        return self.o_proj(out.reshape(batch, seqlen, -1))


class DynamicMaskModel(nn.Module):
    def __init__(self, config: DynamicMaskConfig):
        super().__init__()
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DynamicMaskAttention(config) for _ in range(config.num_hidden_layers))
        self.norms = nn.ModuleList(nn.LayerNorm(config.hidden_size) for _ in range(config.num_hidden_layers))
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, ids):
        hidden = self.embed(ids)
        for norm, layer in zip(self.norms, self.layers):
            hidden = hidden + layer(norm(hidden))
        return self.head(hidden)


@pytest.mark.parametrize("device", DEVICES)
def test_dynamic_mask_model(device):
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(2)).to(device)

    def make(implementation):
        return DynamicMaskModel(DynamicMaskConfig(attn_implementation=implementation))

    check(three_runs(make, lambda model: model(ids), device),
          ["layers.0.A", "layers.0.dt_proj.weight", "layers.1.A", "layers.0.q_proj.weight", "layers.1.v_proj.weight"])


# ------------------------------------------------------------------------------------------------
# The attention function on its own: top-k window, mask formats


class _Module(nn.Module):
    is_causal = True


def _qkv_bias(device, seqlen_q=24, seqlen_k=48):
    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, h, s, 32, generator=generator).to(device, torch.bfloat16)
               for h, s in ((4, seqlen_q), (2, seqlen_k), (2, seqlen_k)))
    bias = torch.randn(2, 2, seqlen_k, generator=generator).to(device, torch.bfloat16)  # (B, Hk, Sk)
    return q, k, v, bias


@pytest.mark.parametrize("device", DEVICES)
def test_window_keeps_the_top_keys_among_visible_ones(device):
    q, k, v, bias = _qkv_bias(device)
    out, weights = flash_dmattn_attention_forward(_Module(), q, k, v, None, attention_bias=bias, scaling=0.2,
                                                  window_size=16)
    assert weights is None and out.shape == (2, 24, 4, 32)
    rows = torch.arange(24, device=device)[:, None]
    causal = (torch.arange(48, device=device)[None, :] <= rows + 24)[None, None]
    mask = create_mask(bias.unsqueeze(2), causal, 2, 24, 48, 16, torch.finfo(torch.bfloat16).min)
    assert (mask.sum(-1) == 16).all()  # every row sees at least 16 keys, so it keeps 16
    args = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, bias.unsqueeze(2), 0.2, True)
    reference, _ = attention_reference(*args)
    baseline, _ = attention_reference(*args, upcast=False)
    assert_within_baseline("out", out, reference, baseline)


@pytest.mark.parametrize("device", DEVICES)
def test_key_lists_give_what_the_window_gives(device):
    """attention_indices from masks.topk_key_indices keep the keys window_size keeps."""
    q, k, v, bias = _qkv_bias(device)
    windowed, _ = flash_dmattn_attention_forward(_Module(), q, k, v, None, attention_bias=bias, scaling=0.2,
                                                 window_size=16)
    rows = torch.arange(24, device=device)[:, None]
    causal = (torch.arange(48, device=device)[None, :] <= rows + 24)[None, None]
    indices = topk_key_indices(bias.unsqueeze(2), causal, 16, torch.finfo(torch.bfloat16).min)
    listed, _ = flash_dmattn_attention_forward(_Module(), q, k, v, None, attention_bias=bias, scaling=0.2,
                                               attention_indices=indices)
    assert torch.equal(windowed, listed)


@pytest.mark.parametrize("device", DEVICES)
def test_mask_formats_agree(device):
    """A 2-D padding mask (with the module's causal flag), the 4-D bool mask transformers' sdpa
    builder makes, and a 4-D additive float mask (eager's format) describe the same attention."""
    q, k, v, _ = _qkv_bias(device, seqlen_q=48)
    padding = torch.ones(2, 48, dtype=torch.bool, device=device)
    padding[1, :7] = False
    rows = torch.arange(48, device=device)[:, None]
    bool_mask = (torch.arange(48, device=device)[None, :] <= rows)[None, None] & padding[:, None, None, :]
    float_mask = torch.zeros(bool_mask.shape, device=device).masked_fill(~bool_mask, float("-inf"))
    module = _Module()
    outs = [flash_dmattn_attention_forward(module, q, k, v, mask)[0] for mask in (padding, bool_mask, float_mask)]
    assert_rounded("2-D vs 4-D bool", outs[0], outs[1])
    assert_rounded("4-D float vs 4-D bool", outs[2], outs[1])


def test_dropout_is_refused():
    q, k, v, _ = _qkv_bias("cpu")
    with pytest.raises(ValueError, match="attention dropout is not supported"):
        flash_dmattn_attention_forward(_Module(), q, k, v, None, dropout=0.1)

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
from transformers import AttentionInterface, AutoModelForCausalLM, LlamaConfig, MistralConfig  # noqa: E402
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402

from flash_dmattn import attention_reference, create_mask, flash_dmattn_func, topk_key_indices  # noqa: E402
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


@pytest.mark.parametrize("device", DEVICES)
def test_layers_share_one_preparation_of_the_mask(device, monkeypatch):
    """Two layers reading one 4-D bool mask prepare it once; a mask changed in place is prepared
    again; results equal those of the bool mask itself."""
    import flash_dmattn.integrations.transformers as integration
    q, k, v, _ = _qkv_bias(device, seqlen_q=48)
    rows = torch.arange(48, device=device)[:, None]
    mask = (torch.arange(48, device=device)[None, :] <= rows)[None, None].expand(2, 1, 48, 48).clone()
    prepared = []
    real = integration.prepare_mask
    monkeypatch.setattr(integration, "prepare_mask", lambda *a, **kw: prepared.append(1) or real(*a, **kw))
    module = _Module()
    outs = [flash_dmattn_attention_forward(module, q, k, v, mask)[0] for _ in range(2)]
    assert len(prepared) == 1 and torch.equal(outs[0], outs[1])
    expected = flash_dmattn_func(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask=mask)
    assert torch.equal(outs[0], expected)
    mask[:, :, 5, 0] = False
    flash_dmattn_attention_forward(module, q, k, v, mask)
    assert len(prepared) == 2
    # The entry goes with the mask (it holds no reference to it).
    key_id = id(mask)
    assert key_id in integration._PREPARED
    del mask, outs
    import gc
    gc.collect()
    assert key_id not in integration._PREPARED


def test_dropout_is_refused():
    q, k, v, _ = _qkv_bias("cpu")
    with pytest.raises(ValueError, match="attention dropout is not supported"):
        flash_dmattn_attention_forward(_Module(), q, k, v, None, dropout=0.1)


# ------------------------------------------------------------------------------------------------
# Packed batches (DataCollatorWithFlattening's flash-attention keywords)


LENGTHS = (5, 9, 1, 3)


def _packed_keywords(device):
    cu = torch.tensor((0,) + tuple(torch.tensor(LENGTHS).cumsum(0).tolist()), dtype=torch.int32, device=device)
    return dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(LENGTHS), max_length_k=max(LENGTHS))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window_size", [None, 4])
@pytest.mark.parametrize("bias_rows", ["shared", "per_query", "none"])
def test_packed_batch_is_its_sequences_apart(device, window_size, bias_rows):
    """One packed call gives, token for token, what a call per sequence gives, gradients included;
    transformers' block-diagonal mask (what the offsets say) is not read."""
    total = sum(LENGTHS)
    generator = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, h, total, 16, generator=generator).to(device, torch.bfloat16) for h in (4, 2, 2))
    bias = {"shared": torch.randn(1, 2, total, generator=generator),
            "per_query": torch.randn(1, 2, total, total, generator=generator), "none": None}[bias_rows]
    bias = None if bias is None else bias.to(device, torch.bfloat16)
    leaves = [t for t in (q, k, v, bias) if t is not None]
    for t in leaves:
        t.requires_grad_(True)
    dout = torch.randn(1, total, 4, 16, generator=generator).to(device, torch.bfloat16)
    module = _Module()
    kept = torch.zeros(total, total, dtype=torch.bool, device=device)  # transformers' packed mask: ignored
    packed, weights = flash_dmattn_attention_forward(module, q, k, v, kept[None, None], attention_bias=bias,
                                                     scaling=0.25, window_size=window_size,
                                                     **_packed_keywords(device))
    assert weights is None and packed.shape == (1, total, 4, 16)
    packed_grads = torch.autograd.grad(packed, leaves, dout)

    starts = (0,) + tuple(torch.tensor(LENGTHS).cumsum(0).tolist())
    pieces = []
    for s, e in zip(starts[:-1], starts[1:]):
        piece_bias = None
        if bias is not None:
            piece_bias = bias[..., s:e] if bias_rows == "shared" else bias[..., s:e, s:e]
        pieces.append(flash_dmattn_attention_forward(module, q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], None,
                                                     attention_bias=piece_bias, scaling=0.25,
                                                     window_size=window_size)[0])
    apart = torch.cat(pieces, dim=1)
    apart_grads = torch.autograd.grad(apart, leaves, dout)
    assert_rounded("out", packed, apart)
    for name, got, expected in zip("qkvb", packed_grads, apart_grads):
        if name == "b" and bias_rows == "per_query":
            # Only the blocks on the diagonal are read; the rest of the packed bias gets no gradient.
            block = torch.zeros(total, total, dtype=torch.bool, device=device)
            for s, e in zip(starts[:-1], starts[1:]):
                block[s:e, s:e] = True
            assert (got[..., ~block] == 0).all()
        assert_rounded(f"d{name}", got, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_packed_llama_matches_its_sequences_run_apart(device, monkeypatch):
    """A stock Llama given a packed row with position_ids and the flash-attention keywords, which
    reach the packed path (not only the block-diagonal mask transformers builds from position_ids)."""
    from flash_dmattn.integrations import transformers as integration

    calls = []
    packed_attention = integration._packed_attention
    monkeypatch.setattr(integration, "_packed_attention", lambda *a: calls.append(1) or packed_attention(*a))
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=NAME).to(device, torch.bfloat16)
    ids = torch.randint(0, 128, (1, sum(LENGTHS)), generator=torch.Generator().manual_seed(5)).to(device)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None].to(device)
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions, **_packed_keywords(device)).logits
        starts = (0,) + tuple(torch.tensor(LENGTHS).cumsum(0).tolist())
        assert len(calls) == config.num_hidden_layers
        apart = torch.cat([model(input_ids=ids[:, s:e]).logits for s, e in zip(starts[:-1], starts[1:])], dim=1)
    assert_rounded("logits", packed, apart)


@pytest.mark.parametrize("device", DEVICES)
def test_packed_mistral_keeps_its_sliding_window(device):
    """Mistral's window lives in transformers' mask, which the packed path does not read: the
    `sliding_window` keyword must give it per sequence."""
    config = MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, sliding_window=3)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=NAME).to(device, torch.bfloat16)
    ids = torch.randint(0, 128, (1, sum(LENGTHS)), generator=torch.Generator().manual_seed(6)).to(device)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None].to(device)
    starts = (0,) + tuple(torch.tensor(LENGTHS).cumsum(0).tolist())
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions, **_packed_keywords(device)).logits
        apart = torch.cat([model(input_ids=ids[:, s:e]).logits for s, e in zip(starts[:-1], starts[1:])], dim=1)
    assert_rounded("logits", packed, apart)


@pytest.mark.parametrize("device", DEVICES)
def test_packed_queries_fewer_than_keys_align_bottom_right(device):
    """cu_seq_lens_q != cu_seq_lens_k (a chunk of new queries per sequence over its keys): each
    sequence's queries are its last keys, as in a call per sequence."""
    lengths_q, lengths_k = (2, 4, 1), (5, 9, 3)
    generator = torch.Generator().manual_seed(7)
    q = torch.randn(1, 4, sum(lengths_q), 16, generator=generator).to(device, torch.bfloat16)
    k, v = (torch.randn(1, 2, sum(lengths_k), 16, generator=generator).to(device, torch.bfloat16) for _ in range(2))
    bias = torch.randn(1, 2, sum(lengths_k), generator=generator).to(device, torch.bfloat16)

    def offsets(lengths):
        return torch.tensor((0,) + tuple(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32, device=device)

    packed, _ = flash_dmattn_attention_forward(_Module(), q, k, v, None, attention_bias=bias, scaling=0.25,
                                               cu_seq_lens_q=offsets(lengths_q), cu_seq_lens_k=offsets(lengths_k),
                                               max_length_q=max(lengths_q), max_length_k=max(lengths_k))
    pieces, sq, sk = [], 0, 0
    for nq, nk in zip(lengths_q, lengths_k):
        pieces.append(flash_dmattn_attention_forward(_Module(), q[:, :, sq:sq + nq], k[:, :, sk:sk + nk],
                                                     v[:, :, sk:sk + nk], None, attention_bias=bias[..., sk:sk + nk],
                                                     scaling=0.25)[0])
        sq, sk = sq + nq, sk + nk
    assert_rounded("out", packed, torch.cat(pieces, dim=1))


def test_packed_batch_refuses_batches_and_key_lists():
    q, k, v, bias = _qkv_bias("cpu", seqlen_q=48)
    keywords = dict(cu_seq_lens_q=torch.tensor([0, 20, 48]), cu_seq_lens_k=torch.tensor([0, 20, 48]),
                    max_length_q=28, max_length_k=28)
    with pytest.raises(ValueError, match="argument 'query'.*expected batch 1, got 2"):
        flash_dmattn_attention_forward(_Module(), q, k, v, None, **keywords)
    with pytest.raises(ValueError, match="argument 'attention_indices'"):
        flash_dmattn_attention_forward(_Module(), q[:1], k[:1], v[:1], None,
                                       attention_indices=torch.zeros(1, 1, 48, 2, dtype=torch.int32), **keywords)
    # A bias in another layout than over the packed tokens (here: 20 keys for 48 tokens).
    with pytest.raises(ValueError, match="argument 'attention_bias'.*over its packed tokens"):
        flash_dmattn_attention_forward(_Module(), q[:1], k[:1], v[:1], None, attention_bias=bias[:1, :, :20],
                                       **keywords)

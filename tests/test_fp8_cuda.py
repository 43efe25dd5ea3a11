"""FP8 rollouts on a GPU with FP8 (compute capability 8.9 or more; skipped elsewhere): the Triton decode kernel over
an FP8 cache against the reference attention over the same quantised values, `torch._scaled_mm`'s FP8 linear
against the product of its dequantised operands and the float product, and the engine decoding with an FP8 cache
and FP8 weights under CUDA graphs. A few seconds in all."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_dapo.rollout import TokenSampling
from trl_dapo.rollout.fp8 import LayerCache, dequantize_rows, fp8_linear, fp8_supported, quantize_rows
from trl_dapo.rollout.paged_attention import reference_decode_attention, triton, triton_decode_attention
from trl_dapo.rollout.paged_engine import PagedRolloutEngine

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or triton is None or not fp8_supported(torch.device("cuda")),
    reason="needs a CUDA GPU with FP8 (compute capability 8.9 or more) and Triton",
)


def paged_case(heads, kv_heads, dim, page, lengths, generator):
    """Rows of `lengths` tokens over pages scattered through a pool, its bf16 k and v quantised into an FP8 cache."""
    device = torch.device("cuda")
    rows, width = len(lengths), max(math.ceil(n / page) for n in lengths) + 1
    pool = rows * width + 3
    slots = (pool + 1) * page
    cache = LayerCache.empty(slots, kv_heads, dim, torch.bfloat16, fp8=True, device=device)
    k = torch.randn(slots, kv_heads, dim, generator=generator, device=device, dtype=torch.bfloat16)
    v = torch.randn(slots, kv_heads, dim, generator=generator, device=device, dtype=torch.bfloat16) * 4
    cache.write(torch.arange(slots, device=device), k, v)
    table = torch.randperm(pool, generator=generator, device=device)[: rows * width].view(rows, width).int()
    lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=generator, device=device, dtype=torch.bfloat16)
    angles = torch.rand(rows, dim // 2, generator=generator, device=device) * 6
    cos, sin = (torch.cat([f(angles)] * 2, 1).to(torch.bfloat16) for f in (torch.cos, torch.sin))
    position = (lens - 1).clamp(min=0)
    write = table.gather(1, (position // page).long()[:, None])[:, 0].long() * page + position % page
    write[lens == 0] = pool * page
    return qkv, cos, sin, write, cache, table, lens


@pytest.mark.parametrize(
    "heads, kv_heads, dim, page, lengths, splits, norm",
    [
        (28, 4, 128, 16, [300, 0, 1, 77], 3, False),
        (16, 8, 128, 16, [1000, 17], 8, True),
        (8, 2, 64, 16, [5], 1, False),
    ],
    ids=["qwen2.5-7b-heads", "qwen3-norms-many-splits", "one-split"],
)
def test_the_triton_kernel_reads_an_fp8_cache_as_the_reference_does(heads, kv_heads, dim, page, lengths, splits, norm):
    """Both write the new token quantised (the same e4m3 values and scales) and attend over the dequantised cache;
    the kernel's bf16 products differ from the float32 reference by bf16 rounding."""
    generator = torch.Generator("cuda").manual_seed(0)
    qkv, cos, sin, write, cache, table, lens = paged_case(heads, kv_heads, dim, page, lengths, generator)
    qk_norm = (torch.rand(dim, device="cuda").bfloat16() + 0.5,) * 2 if norm else None
    args = (page, heads, qk_norm, 1e-6)
    mine = LayerCache(*(tensor.clone() for tensor in cache))
    expected = reference_decode_attention(
        qkv, cos, sin, write, cache.k, cache.v, table, lens, *args, max(lengths), k_scale=cache.k_scale,
        v_scale=cache.v_scale,
    )  # fmt: skip
    out = triton_decode_attention(
        qkv, cos, sin, write, mine.k, mine.v, table, lens, *args, splits, k_scale=mine.k_scale, v_scale=mine.v_scale
    )
    assert ((out.float() - expected.float()).abs() <= 0.02 * expected.float().abs() + 0.02).all()
    assert (out[lens == 0] == 0).all()
    live = write[lens > 0]
    # the rotation rounds as the reference's up to an ulp (see `_rotated`), which can move a value to its e4m3
    # neighbour: the new k agrees to within one e4m3 step, v (not rotated) exactly
    for mine_values, values in ((mine.k, cache.k), (mine.v, cache.v)):
        assert (mine_values[live].float() - values[live].float()).abs().le(values[live].float().abs() / 8 + 1e-3).all()
    assert torch.equal(mine.v[live].view(torch.uint8), cache.v[live].view(torch.uint8))
    assert torch.allclose(mine.k_scale[live], cache.k_scale[live], rtol=2e-2)
    assert torch.equal(mine.v_scale[live], cache.v_scale[live])


@pytest.mark.parametrize("rows", [1, 8, 33])
def test_the_fp8_linear_is_the_product_of_its_dequantised_operands(rows):
    generator = torch.Generator("cuda").manual_seed(1)
    x = torch.randn(rows, 256, generator=generator, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(384, 256, generator=generator, device="cuda", dtype=torch.bfloat16) * 0.05
    bias = torch.randn(384, generator=generator, device="cuda", dtype=torch.bfloat16)
    values, scale = quantize_rows(weight)
    out = fp8_linear(x, values, scale, bias)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 384)
    x_values, x_scale = quantize_rows(x)
    product = dequantize_rows(x_values, x_scale).double() @ dequantize_rows(values, scale).double().T
    expected = product + bias.double()
    # the FP8 tensor cores accumulate in float32; the product and then the sum with the bias round to bf16, each
    # within 2^-9 of its result (bounded with twice that, and the float32 accumulation's slack)
    assert ((out.double() - expected).abs() <= 2**-8 * (product.abs() + expected.abs()) + 1e-3).all()
    exact = x.double() @ weight.double().T + bias.double()
    assert (out.double() - exact).abs().max() < 0.1 * exact.abs().max()
    batched = fp8_linear(x.view(1, rows, 256), values, scale, bias)  # leading dimensions are kept
    assert batched.shape == (1, rows, 384) and torch.equal(batched[0], out)


def test_the_engine_decodes_with_fp8_cache_and_weights_under_cuda_graphs(tiny_model):
    """FP8 cache and weights through the CUDA-graph decode step (the Triton kernel, `torch._scaled_mm` in the
    compiled layers): every row to its limit, the first token's logprob (the prefill's, FP8 weights only) a few
    hundredths from bf16's (the tiny model's distributions are near uniform over its 384 tokens)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16).cuda().eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    batch = [tokenizer(f"What is {i} + {i * 3 % 7}?", add_special_tokens=False)["input_ids"] for i in range(6)]
    outputs = {}
    for precision in ("bf16", "fp8"):
        engine = PagedRolloutEngine(
            model, eos_token_ids=[], pad_token_id=tokenizer.pad_token_id, dtype=torch.bfloat16,
            cuda_graph=True, sync_every=4, kv_cache_dtype=precision, weights_dtype=precision,
        )  # fmt: skip
        outputs[precision] = engine.generate(batch, TokenSampling(max_new_tokens=12, greedy=True))
    assert engine.fp8_kv_cache and engine.fp8_weights and engine.attention_kernel == "triton"
    plain, fp8 = outputs["bf16"], outputs["fp8"]
    first = (plain.logprobs[:, 0] - fp8.logprobs[:, 0]).abs()
    assert 0 < first.max() < 0.1 and torch.isfinite(fp8.logprobs).all()
    assert [len(c) for c in fp8.completions] == [12] * 6  # no stop token: every row runs to the limit

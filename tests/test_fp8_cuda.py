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
from trl_dapo.rollout.paged_attention import (
    reference_attention,
    reference_decode_attention,
    rotate,
    rotated_heads,
    triton,
    triton_decode_attention,
)
from trl_dapo.rollout.paged_engine import PagedRolloutEngine

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or triton is None or not fp8_supported(torch.device("cuda")),
    reason="needs a CUDA GPU with FP8 (compute capability 8.9 or more) and Triton",
)


def paged_case(heads, kv_heads, dim, page, lengths, generator):
    """Rows of `lengths` tokens over pages scattered through a pool, its bf16 k and v quantised into an FP8 cache."""
    device = generator.device
    rows, width = len(lengths), max(math.ceil(n / page) for n in lengths) + 1
    pool = rows * width + 3
    slots = (pool + 1) * page
    cache = LayerCache.empty(slots, kv_heads, dim, torch.bfloat16, fp8=True, device=device)
    k = torch.randn(slots, kv_heads, dim, generator=generator, device=device, dtype=torch.bfloat16)
    # v's magnitude varies by token (e^N(0, 1)), so its scales do: a scale read for another token shows
    magnitudes = torch.randn(slots, kv_heads, 1, generator=generator, device=device).exp() * 4
    v = (torch.randn(slots, kv_heads, dim, generator=generator, device=device) * magnitudes).bfloat16()
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


def kernel_rotation(qkv, cos, sin, heads, kv_heads, qk_norm):
    """q (rows, heads, dim) as the kernel's `_rotated` computes it: the norm's weight product and the rotation in
    float32, rounded to bf16 once, where `rotated_heads` rounds each product and the sum."""
    dim = qkv.size(1) // (heads + 2 * kv_heads)
    x = qkv[:, : heads * dim].view(-1, heads, dim)
    if qk_norm is not None:
        x32 = x.float()
        normalised = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()
        x = qk_norm[0].float() * normalised.float()
    return rotate(x.float(), cos.float()[:, None], sin.float()[:, None]).bfloat16()


def k_rotation_margin(qkv, cos, sin, heads, kv_heads, qk_norm):
    """The most the kernel's rotated new k (rows, kv_heads, dim) lies from the reference's: the kernel rounds
    x cos + rotate_half(x) sin once, the reference each product and the sum (bf16 rounds within 2^-8), so within
    3.01 * 2^-8 (|x cos| + |rotate_half(x) sin|), bounded with 2^-6; with the norm twice that (the reference also
    rounds the product with the norm's weight, and the kernel's float32 rsqrt and sum can round the normalised x
    an ulp apart: 3 * 2^-8 more)."""
    k = rotated_heads(qkv, torch.ones_like(cos), torch.zeros_like(sin), heads, kv_heads, qk_norm, 1e-6)[1]
    half = k.size(-1) // 2
    swapped = torch.cat((k[..., half:], k[..., :half]), -1)  # normalised, not rotated
    products = k.float().abs() * cos.float().abs()[:, None] + swapped.float().abs() * sin.float().abs()[:, None]
    return 2.0 ** (-5 if qk_norm is not None else -6) * products


def check_fp8_decode(heads, kv_heads, dim, page, lengths, splits, norm, generator):
    """The kernel's FP8 decode step against the reference (see the test), on `generator`'s device."""
    qkv, cos, sin, write, cache, table, lens = paged_case(heads, kv_heads, dim, page, lengths, generator)
    qk_norm = (torch.rand(dim, generator=generator, device=qkv.device).bfloat16() + 0.5,) * 2 if norm else None
    args = (page, heads, qk_norm, 1e-6)
    mine = LayerCache(*(tensor.clone() for tensor in cache))
    reference_decode_attention(
        qkv, cos, sin, write, cache.k, cache.v, table, lens, *args, max(lengths), k_scale=cache.k_scale,
        v_scale=cache.v_scale,
    )  # fmt: skip
    out = triton_decode_attention(
        qkv, cos, sin, write, mine.k, mine.v, table, lens, *args, splits, k_scale=mine.k_scale, v_scale=mine.v_scale
    )
    k_margin = k_rotation_margin(qkv, cos, sin, heads, kv_heads, qk_norm)
    # the new token's write: v (not rotated) and its scale bitwise, both sides dividing exactly; k dequantised
    # within the rotations' margin and each side's e4m3 rounding (2^-4 of the value, or 2^-10 of the scale below
    # e4m3's normal range). Its e4m3 values can differ by far more than a step: an ulp in the largest value moves
    # the scale, and where x cos and rotate_half(x) sin cancel, the margin is large against the value
    live = lens > 0
    slots = write[live]
    assert torch.equal(mine.v[slots].view(torch.uint8), cache.v[slots].view(torch.uint8))
    assert torch.equal(mine.v_scale[slots], cache.v_scale[slots])
    (k_mine, _), (k_reference, _) = mine.read(slots), cache.read(slots)
    rounding = 2**-4 * (k_mine.abs() + k_reference.abs()) + 2**-10 * (mine.k_scale + cache.k_scale)[slots, :, None]
    assert ((k_mine - k_reference).abs() <= k_margin[live] + rounding / (1 - 2**-4)).all()
    # the attention, over the cache as the kernel left it and with the kernel's q: an e4m3 step in the new k moves
    # the new token's score and so the output by more than rounding (up to 0.02, 20 of its ulps, on a 77-token row
    # in a CPU emulation), which is the write's difference, bounded above, not the attention's. The kernel rounds each
    # softmax weight (times its v scale) to bf16 before its product with v, within 2^-8, so its output moves by at
    # most 2^-8 sum_t w_t |v_t| (`spread`); each output rounds to bf16, within 2^-8 of its value. (The emulated q
    # can round a value an ulp off the kernel's where float32 order or the GPU's rsqrt tip it: a score moves by
    # a few 10^-4 per such value, inside the bound's 2^-8 spread.)
    q = kernel_rotation(qkv, cos, sin, heads, kv_heads, qk_norm)
    own = reference_attention(q, mine.k, mine.v, table, lens, page, max(lengths), *mine[2:]).float()
    v_magnitudes = (mine.v.view(torch.uint8) & 0x7F).view(mine.v.dtype)  # the sign bit cleared
    spread = reference_attention(q, mine.k, v_magnitudes, table, lens, page, max(lengths), *mine[2:]).float()
    bound = 2**-8 * 1.01 * (2 * own.abs() + spread) + 1e-4
    assert ((out.float() - own).abs() <= bound).all(), ((out.float() - own).abs() / bound).amax((1, 2))
    assert (out[lens == 0] == 0).all()


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
    """The kernel writes the new token quantised as the reference does, but for its k's rotation rounding once
    (some values an ulp apart, then an e4m3 step), and attends over the cache as it left it as the reference
    attention does, but for bf16 rounding of its softmax weights and output (bounds derived in
    `check_fp8_decode`). The output is not compared with the reference's over its own write: an e4m3 step in the
    new k moves it by more than rounding (that comparison, with a bound of 0.02 + 2% not derived, failed on an
    H100)."""
    check_fp8_decode(heads, kv_heads, dim, page, lengths, splits, norm, torch.Generator("cuda").manual_seed(0))


def test_quantize_rows_scales_are_ieee_quotients():
    """On CUDA, PyTorch divides by a Python number as a product with its rounded reciprocal, an ulp off the IEEE
    quotient for about half the values; the decode kernel divides exactly (`tl.div_rn`), so the scales of the tokens
    prefill and the reference write must be IEEE quotients for the cache to hold the same scales whoever wrote it."""
    generator = torch.Generator("cuda").manual_seed(2)
    x = torch.randn(4096, 128, generator=generator, device="cuda", dtype=torch.bfloat16) * 3
    scale = quantize_rows(x)[1]
    amax = x.float().abs().amax(-1)
    assert torch.equal(scale.cpu(), (amax.cpu().double() / 448).float())  # the IEEE quotient, rounded once
    assert not torch.equal(scale, amax * (1 / 448))  # what a Python divisor gives on CUDA, for about half


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

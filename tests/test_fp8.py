"""FP8 rollouts on the CPU: e4m3 round trips within e4m3's rounding (hand-derived bounds), the FP8 KV cache written
and read by the reference decode attention exactly as the reference reads its dequantised values, an FP8 linear's
quantised product within the bound its operands' rounding gives, the engine with an FP8 cache, and the config and
set-up errors. The CUDA kernels (the Triton decode kernel over an FP8 cache, `torch._scaled_mm`) are
`tests/test_fp8_cuda.py`'s."""

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers import (
    INTERPRETER_LOOP_PROBE,
    arithmetic_prompts,
    dapo_args,
    first_token_parity,
    needs_triton,
    run_in_triton_interpreter,
)
from trl_dapo import DAPOConfig, DAPOTrainer
from trl_dapo.rollout import TokenSampling
from trl_dapo.rollout.fp8 import (
    FP8,
    FP8_LINEARS,
    MIN_SCALE,
    LayerCache,
    cache_bytes_per_token,
    dequantize_rows,
    fp8_linear,
    quantize_linears,
    quantize_rows,
)
from trl_dapo.rollout.paged_attention import reference_attention, reference_decode_attention, rotated_heads
from trl_dapo.rollout.paged_engine import PagedRolloutEngine
from trl_dapo.rollout.weights import gather_nothing
from trl_dapo.testing import paged_decode_case
from trl_dapo.trainer.collection.engine_choice import EngineSetUp, select_rollout_engine
from trl_dapo.trainer.set_up import check_set_up

# e4m3: 3 mantissa bits, so round-to-nearest is within a relative 2^-4 of a value in the normal range (|x| / scale
# >= 2^-6); below it the spacing is 2^-9, so within 2^-10 absolutely (times the scale)
NORMAL_RELATIVE, SUBNORMAL_ABSOLUTE = 2.0**-4, 2.0**-10
FLOAT32_SLACK = 1e-6  # the float32 division and product around the rounding


def rounding_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Most |dequantised - x| per element of x (..., n) quantised with `scale` (...)."""
    bound = torch.maximum(NORMAL_RELATIVE * x.abs(), SUBNORMAL_ABSOLUTE * scale.unsqueeze(-1))
    return bound * (1 + FLOAT32_SLACK)


def spread_vectors() -> torch.Tensor:
    """(64, 4, 128) vectors over six decades, head 0's with an outlier (its other values fall subnormal), one zero."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 128, generator=generator) * torch.logspace(-3, 3, 64)[:, None, None]
    x[:, 0, :2] *= 1e4
    x[-1, -1] = 0
    return x


def test_a_round_trip_is_within_e4m3_rounding_of_each_value():
    x = spread_vectors()
    values, scale = quantize_rows(x)
    assert values.dtype == FP8 and scale.dtype == torch.float32 and scale.shape == (64, 4)
    back = dequantize_rows(values, scale)
    error = (back - x).abs()
    assert (error <= rounding_bound(x, scale)).all()
    # the bound is met by rounding, not by exactness: normal values do move, by more than a quarter of the bound
    normal = x.abs() >= 2.0**-6 * scale.unsqueeze(-1)
    assert (error[normal] / x[normal].abs()).max() > NORMAL_RELATIVE / 4
    # the largest magnitude of each vector maps to e4m3's largest finite value (448): no overflow, no NaN
    assert torch.isfinite(back).all()
    assert torch.equal(values[:-1].float().abs().amax(-1), torch.full((63, 4), 448.0))
    # a zero vector gets the smallest scale and zeros back
    assert scale[-1, -1] == MIN_SCALE and (back[-1, -1] == 0).all()


def test_the_layer_cache_writes_reads_and_copies_slots_quantised():
    generator = torch.Generator().manual_seed(1)
    cache = LayerCache.empty(10, 2, 16, torch.float32, fp8=True, device="cpu")
    plain = LayerCache.empty(10, 2, 16, torch.float32, fp8=False, device="cpu")
    assert cache.fp8 and cache.k.dtype == FP8 and cache.k_scale.shape == (10, 2) and not plain.fp8
    k, v = torch.randn(2, 2, 16, generator=generator), torch.randn(2, 2, 16, generator=generator) * 100
    slots = torch.tensor([3, 7])
    for layer in (cache, plain):
        layer.write(slots, k, v)
        layer.copy(torch.tensor([5]), torch.tensor([7]))
    k_read, v_read = cache.read(slots)
    assert (k_read - k).abs().le(rounding_bound(k, quantize_rows(k)[1])).all()
    assert (v_read - v).abs().le(rounding_bound(v, quantize_rows(v)[1])).all()
    assert torch.equal(cache.read(torch.tensor([5]))[1], v_read[1:])  # the copy carries the scales too
    assert torch.equal(plain.read(slots)[0], k) and torch.equal(plain.read(torch.tensor([5]))[1], v[1:])
    # a token's k and v: a byte per value and a float32 scale per head, against two bytes per value in bf16
    assert cache_bytes_per_token(28, 4, 128, torch.bfloat16, fp8=True) == 2 * 28 * 4 * 132
    assert cache_bytes_per_token(28, 4, 128, torch.bfloat16, fp8=False) == 2 * 28 * 4 * 256


def decode_case(seed: int = 0):
    """A decode step of rows of different lengths (an idle one, one whose only token is the new one) over pages
    scattered through a pool, its float32 caches random."""
    torch.manual_seed(seed)
    return dict(**paged_decode_case(6, 2, 16, 4, [5, 0, 37, 1], value_scale=3), page=4, heads=6)


def test_the_reference_decode_attention_reads_an_fp8_cache_as_its_dequantised_values():
    """With an FP8 cache the step writes the new token quantised and attends over every token dequantised: the same
    output as the float32 reference over the dequantised cache, the new token's slot holding its quantised k and v;
    and not the unquantised cache's output (the cache is read quantised)."""
    case = decode_case()
    slots = case["k"].size(0)
    cache = LayerCache.empty(slots, 2, 16, torch.float32, fp8=True, device="cpu")
    cache.write(torch.arange(slots), case["k"], case["v"])
    args = (case["qkv"], case["cos"], case["sin"], case["write"])
    rest = (case["table"], case["lens"], case["page"], case["heads"], None, 1e-6, 37)
    out = reference_decode_attention(*args, cache.k, cache.v, *rest, k_scale=cache.k_scale, v_scale=cache.v_scale)
    q, k_new, v_new = rotated_heads(case["qkv"], case["cos"], case["sin"], case["heads"], 2, None, 1e-6)
    live = case["lens"] > 0
    for tensor, scales, new in ((cache.k, cache.k_scale, k_new), (cache.v, cache.v_scale, v_new)):
        values, scale = quantize_rows(new)
        assert torch.equal(tensor[case["write"]][live].float(), values[live].float())
        assert torch.equal(scales[case["write"]][live], scale[live])
    k_read, v_read = cache.read(torch.arange(slots))
    expected = reference_attention(q, k_read, v_read, case["table"], case["lens"], case["page"], 37)
    assert (out - expected).abs().max() < 1e-6
    assert (out[~live] == 0).all()
    unquantised = reference_decode_attention(*args, case["k"].clone(), case["v"].clone(), *rest)
    assert 1e-3 < (out - unquantised).abs().max() < 0.5


def test_an_fp8_linears_product_is_within_its_operands_rounding():
    """The FP8 linear's math on the CPU: x quantised per row, the weight per output channel (`quantize_linears`),
    their dequantised product against the float64 product, within Σ_k |x_k| e_w + |w_k| e_x + e_x e_w (each
    operand's rounding bound e); `torch._scaled_mm` computes the same product on FP8 tensor cores (CUDA test)."""
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(5, 64, generator=generator) * torch.logspace(-2, 2, 5)[:, None]
    layer = {name: torch.randn(48, 64, generator=generator) * 0.05 for name in FP8_LINEARS}
    quantize_linears([layer])
    weight, w_scale = layer["down_weight"], layer["down_weight_scale"]
    assert layer["down_weight_fp8"].dtype == FP8 and w_scale.shape == (48,)
    x_values, x_scale = quantize_rows(x)
    product = (
        dequantize_rows(x_values, x_scale).double() @ dequantize_rows(layer["down_weight_fp8"], w_scale).double().T
    )
    exact = x.double() @ weight.double().T
    e_x, e_w = rounding_bound(x, x_scale).double(), rounding_bound(weight, w_scale).double()
    bound = x.double().abs() @ e_w.T + e_x @ weight.double().abs().T + e_x @ e_w.T
    assert ((product - exact).abs() <= bound).all()
    assert ((product - exact).abs() / bound).max() > 0.01  # quantised, not exact
    # a later sync refreshes the FP8 copies in place (graphs captured over them stay valid)
    storage, before = layer["down_weight_fp8"].data_ptr(), w_scale.clone()
    layer["down_weight"].mul_(2)
    quantize_linears([layer])
    assert layer["down_weight_fp8"].data_ptr() == storage and torch.equal(layer["down_weight_scale"], 2 * before)


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model):
    return AutoModelForCausalLM.from_pretrained(tiny_model).eval(), AutoTokenizer.from_pretrained(tiny_model)


def test_the_engine_decodes_over_an_fp8_cache(model_and_tokenizer):
    """The first token is sampled from the prefill, which attends over the unquantised k and v: its logprob is the
    bf16-cache engine's exactly. Later tokens read the FP8 cache: their logprobs move, by little."""
    model, tokenizer = model_and_tokenizer
    texts = [f"What is {i} + {i * 3 % 7}? Answer:" for i in range(4)]
    batch = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    outputs = {}
    for kv in ("bf16", "fp8"):
        engine = PagedRolloutEngine(
            model, eos_token_ids=[], pad_token_id=tokenizer.pad_token_id, dtype=torch.float32, cuda_graph=False,
            page_size=4, sync_every=3, kv_cache_dtype=kv,
        )  # fmt: skip
        outputs[kv] = engine.generate(batch, TokenSampling(max_new_tokens=6, greedy=True))
    assert (
        engine.fp8_kv_cache
        and engine.cache_bytes_per_token()
        < 0.6 * 4 * engine.head_dim * 2 * len(engine.snapshot.layers) * engine.num_kv_heads
    )  # float32 caches take 4 bytes per value
    plain, fp8 = outputs["bf16"].logprobs, outputs["fp8"].logprobs
    assert torch.equal(plain[:, 0], fp8[:, 0])
    assert 0 < (plain - fp8).abs().max() < 0.05


@pytest.mark.skipif(
    not (shutil.which("g++") or shutil.which("clang++")), reason="the CPU compiler needs a C++ compiler"
)
def test_the_compiled_prefill_writes_the_fp8_cache_as_the_eager_one(model_and_tokenizer):
    """The compiled layer quantises and writes the cache (byte views of the e4m3 tensors) as the eager one does:
    the same tokens and logprobs (CUDA compiles the same code)."""
    model, tokenizer = model_and_tokenizer
    batch = [tokenizer(f"What is {i} + 3?", add_special_tokens=False)["input_ids"] for i in range(4)]
    outputs = [
        PagedRolloutEngine(
            model, eos_token_ids=[], pad_token_id=tokenizer.pad_token_id, dtype=torch.float32, cuda_graph=False,
            page_size=4, sync_every=3, compile_decode=compiled, kv_cache_dtype="fp8",
        ).generate(batch, TokenSampling(max_new_tokens=6, greedy=True))
        for compiled in (False, True)
    ]  # fmt: skip
    assert outputs[0].completions == outputs[1].completions
    assert (outputs[0].logprobs - outputs[1].logprobs).abs().max() < 1e-5


def test_fp8_settings_are_checked_before_any_model_loads(tmp_path):
    fp8 = dict(old_logprobs="recompute", rollout_correction="token_mask", rollout_engine="paged")
    with pytest.raises(ValueError, match=r"DAPOConfig.rollout_kv_cache_dtype='fp16' is invalid: use one of"):
        dapo_args(tmp_path, rollout_kv_cache_dtype="fp16")
    with pytest.raises(ValueError, match=r"rollout_weights_dtype='fp8' is invalid: .*old_logprobs='recompute'"):
        dapo_args(tmp_path, rollout_weights_dtype="fp8", rollout_engine="paged")
    with pytest.raises(
        ValueError, match=r"rollout_kv_cache_dtype='fp8' is invalid: .*rollout_correction='token_mask'"
    ):
        dapo_args(tmp_path, rollout_kv_cache_dtype="fp8", old_logprobs="recompute", rollout_engine="paged")
    with pytest.raises(ValueError, match=r"rollout_kv_cache_dtype='fp8' is invalid: it needs trl-dapo's paged engine"):
        dapo_args(tmp_path, **{**fp8, "rollout_engine": "trl"}, rollout_kv_cache_dtype="fp8")
    # the device, known before a model loads: FP8 weights need FP8 tensor cores, the CPU has none
    args = dapo_args(tmp_path, **fp8, rollout_weights_dtype="fp8")
    with pytest.raises(ValueError, match=r"rollout_weights_dtype='fp8' cannot run here: the cpu device has no FP8"):
        check_set_up(args, first_token_parity)
    # an FP8 cache runs on the CPU by the paged engine only: 'auto' would generate with TRL's path, in float32
    args = dapo_args(tmp_path, **{**fp8, "rollout_engine": "auto"}, rollout_kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match=r"rollout_kv_cache_dtype='fp8' needs trl-dapo's paged engine"):
        check_set_up(args, first_token_parity)
    check_set_up(dapo_args(tmp_path, **fp8, rollout_kv_cache_dtype="fp8"), first_token_parity)
    assert DAPOConfig(output_dir=str(tmp_path)).rollout_kv_cache_dtype == "bf16"


def test_the_engine_refuses_fp8_weights_without_fp8_tensor_cores(model_and_tokenizer):
    model = model_and_tokenizer[0]
    with pytest.raises(ValueError, match=r"weights_dtype='fp8' cannot run here: the cpu device has no FP8"):
        PagedRolloutEngine(model, eos_token_ids=[0], pad_token_id=0, dtype=torch.float32, cuda_graph=False,
                           weights_dtype="fp8")  # fmt: skip
    with pytest.raises(ValueError, match=r"kv_cache_dtype='int8' must be one of \('bf16', 'fp8'\)"):
        PagedRolloutEngine(model, eos_token_ids=[0], pad_token_id=0, dtype=torch.float32, cuda_graph=False,
                           kv_cache_dtype="int8")  # fmt: skip


def test_a_trainer_with_an_fp8_cache_trains_with_the_correction_metrics(tiny_model, tmp_path):
    """The trainer builds its engine with the FP8 cache and logs how much the correction masked."""
    args = dapo_args(
        tmp_path, per_device_train_batch_size=8, max_steps=1, rollout_engine="paged", rollout_kv_cache_dtype="fp8",
        old_logprobs="recompute", rollout_correction="token_mask",
    )  # fmt: skip
    trainer = DAPOTrainer(
        model=tiny_model, reward_funcs=first_token_parity, args=args, train_dataset=arithmetic_prompts(16)
    )
    assert trainer.paged_engine.fp8_kv_cache and not trainer.paged_engine.fp8_weights
    trainer.train()
    (logs,) = [h for h in trainer.state.log_history if "rollout_correction/token_fraction" in h]
    assert 0 <= logs["rollout_correction/token_fraction"] < 0.5


def test_auto_does_not_fall_back_to_trls_path_with_fp8(model_and_tokenizer, tmp_path):
    """On CUDA `rollout_engine="auto"` falls back to TRL's path where the engine cannot serve the set-up (here a
    multimodal model), which would generate in bf16, the FP8 setting ignored: with FP8 that is an error instead."""
    settings = dict(rollout_engine="auto", old_logprobs="recompute", rollout_correction="token_mask")
    set_up = dict(
        model=model_and_tokenizer[0], device=torch.device("cuda"), eos_token_ids=[0], pad_token_id=0, is_vlm=True,
        rollout_func=None, calls_tools=False, zero3=False, fsdp1=False, gather=gather_nothing, show_progress=False,
    )  # fmt: skip
    assert select_rollout_engine(EngineSetUp(args=dapo_args(tmp_path, **settings), **set_up)) is None
    args = dapo_args(tmp_path, **settings, rollout_kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match=r"rollout_kv_cache_dtype='fp8' needs trl-dapo's paged engine.*multimodal"):
        select_rollout_engine(EngineSetUp(args=args, **set_up))


FP8_INTERPRETER_SCRIPT = """
import math, torch
from trl_dapo.rollout.fp8 import LayerCache
from trl_dapo.rollout.paged_attention import (
    reference_attention, reference_decode_attention, rotated_heads, triton_decode_attention,
)
from trl_dapo.testing import paged_decode_case
torch.manual_seed(0)
cases = [(4, 2, 16, 4, [5, 0, 37, 1], 3, False), (14, 2, 32, 16, [100, 33], 4, True), (6, 3, 16, 4, [9, 2], 1, False)]
for heads, kv_heads, dim, page, lengths, splits, norm in cases:
    case = paged_decode_case(heads, kv_heads, dim, page, lengths, value_scale=3)
    qkv, cos, sin, write, table, lens = (case[name] for name in ("qkv", "cos", "sin", "write", "table", "lens"))
    slots = case["k"].size(0)
    cache = LayerCache.empty(slots, kv_heads, dim, torch.float32, fp8=True, device="cpu")
    cache.write(torch.arange(slots), case["k"], case["v"])
    qk_norm = (torch.rand(dim) + 0.5, torch.rand(dim) + 0.5) if norm else None
    mine = LayerCache(*(tensor.clone() for tensor in cache))
    args = (page, heads, qk_norm, 1e-6)
    reference_decode_attention(
        qkv, cos, sin, write, cache.k, cache.v, table, lens, *args, max(lengths), k_scale=cache.k_scale,
        v_scale=cache.v_scale,
    )
    out = triton_decode_attention(
        qkv, cos, sin, write, mine.k, mine.v, table, lens, *args, splits, block_n=16, k_scale=mine.k_scale,
        v_scale=mine.v_scale,
    )
    q = rotated_heads(qkv, cos, sin, heads, kv_heads, qk_norm, 1e-6)[0]
    own = reference_attention(q, *mine.read(torch.arange(slots)), table, lens, page, max(lengths))
    assert (out - own).abs().max() < 1e-5, (out - own).abs().max()
    assert (out[lens == 0] == 0).all()
    live = write[lens > 0]
    assert torch.equal(mine.k_scale, cache.k_scale) and torch.equal(mine.v_scale, cache.v_scale)
    for kernel, torch_values in ((mine.k[live].float(), cache.k[live].float()), (mine.v[live].float(), cache.v[live].float())):
        differ = kernel != torch_values
        powers = torch_values[differ].abs().log2()
        assert (powers == powers.round()).all() and torch.equal(kernel[differ] * 2, torch_values[differ])
        assert differ.float().mean() < 0.05
"""


@needs_triton
def test_the_triton_kernel_reads_and_writes_an_fp8_cache_in_the_interpreter():
    """The decode kernel over an FP8 cache in Triton's CPU interpreter (float32 inputs): its output equals the
    reference attention over the cache as the kernel left it (the scores scaled by k's scales, the softmax weights by
    v's, the new token quantised and read back), its scales are PyTorch's, and its e4m3 values are too, except that
    the interpreter's software conversion loses the carry when a value rounds up to a power of two (125.6 to 64, not
    128): the hardware conversion compiled kernels use has no such defect (`tests/test_fp8_cuda.py`)."""
    probe = run_in_triton_interpreter(INTERPRETER_LOOP_PROBE)
    if probe.returncode != 0:
        pytest.skip(f"Triton's interpreter cannot run a loop with a loaded bound here: {probe.stderr.strip()[-300:]}")
    result = run_in_triton_interpreter(FP8_INTERPRETER_SCRIPT)
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_fp8_linear_through_scaled_mm_is_the_product_of_its_dequantised_operands():
    """`torch._scaled_mm` runs on the CPU too (the engine refuses FP8 weights there: no FP8 tensor cores, nothing to
    gain): the operands' layout and scales as `fp8_linear` passes them give the product of the dequantised operands,
    rounded to bf16, with the bias added in bf16 (two roundings, each within 2^-9 of its result; bounded here with
    twice that) and leading dimensions kept."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 64, generator=generator).bfloat16()
    weight = (torch.randn(48, 64, generator=generator) * 0.05).bfloat16()
    bias = torch.randn(48, generator=generator).bfloat16()
    values, scale = quantize_rows(weight)
    out = fp8_linear(x, values, scale, bias)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 5, 48)
    x_values, x_scale = quantize_rows(x)
    product = dequantize_rows(x_values, x_scale).double() @ dequantize_rows(values, scale).double().T
    expected = product + bias.double()
    assert ((out.double() - expected).abs() <= 2**-8 * (product.abs() + expected.abs()) + 1e-4).all()
    assert (out.double() - expected).abs().max() > 0  # rounded, not computed in float64

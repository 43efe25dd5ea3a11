"""The padding-free attention's CUDA path (PyTorch's variable-length flash attention, bf16) against the per-row SDPA
reference, forward and backward, and a packed bf16 forward of a model against each row's own forward. Skipped
without CUDA."""

import pytest
import torch
from transformers import AutoModelForCausalLM
from trl.trainer.utils import add_fused_lm_head

from trl_dapo.tiny_model import build_tiny_model
from trl_dapo.trainer.training.packed_attention import (
    enable_packed_attention,
    forward_packed,
    packed_attention,
    reference_packed_attention,
)
from trl_dapo.trainer.training.packing import pack_rows, unpack_scores

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize(("query_heads", "kv_heads", "head_dim"), [(12, 2, 128), (14, 2, 64), (8, 8, 64)])
def test_flash_varlen_matches_the_reference_forward_and_backward(query_heads, kv_heads, head_dim):
    torch.manual_seed(0)
    lengths = [1, 300, 17, 1024, 2, 700]
    total = sum(lengths)
    bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda")
    shapes = [(1, query_heads, total, head_dim), (1, kv_heads, total, head_dim), (1, kv_heads, total, head_dim)]
    inputs = [torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for shape in shapes]
    grad = torch.randn(1, total, query_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    out = packed_attention(*inputs, bounds, max(lengths), scaling=head_dim**-0.5)
    grads = torch.autograd.grad(out, inputs, grad)
    reference_inputs = [x.detach().float().requires_grad_() for x in inputs]
    reference = reference_packed_attention(*reference_inputs, bounds, scaling=head_dim**-0.5)
    reference_grads = torch.autograd.grad(reference, reference_inputs, grad.float())
    torch.testing.assert_close(out.float(), reference, atol=2e-2, rtol=2e-2)
    for name, value, expected in zip("qkv", grads, reference_grads, strict=True):
        torch.testing.assert_close(value.float(), expected, atol=5e-2, rtol=5e-2, msg=name)


def test_a_packed_bf16_forward_scores_rows_as_their_own_forwards(tmp_path):
    path = build_tiny_model(tmp_path / "m", hidden_size=256, num_heads=4, num_kv_heads=2)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda()
    enable_packed_attention(model)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    generator = torch.Generator().manual_seed(0)
    lengths = [(5, 1), (9, 200), (3, 57), (12, 256)]  # (prompt, completion)
    width = max(c for _, c in lengths)
    prompt_width = max(p for p, _ in lengths)
    rows, masks = [], []
    for prompt, completion in lengths:
        ids = torch.randint(3, 300, (prompt + completion,), generator=generator).tolist()
        left, right = prompt_width - prompt, width - completion
        rows.append([0] * left + ids + [0] * right)
        masks.append([0] * left + [1] * (prompt + completion) + [0] * right)
    input_ids, attention = torch.tensor(rows, device="cuda"), torch.tensor(masks, device="cuda")
    packed = pack_rows(input_ids, attention, width)
    with torch.no_grad():
        out = forward_packed(model, packed)
        logps = unpack_scores(out.log_probs, packed, width)
        for row, (_, completion) in enumerate(lengths):
            ids = input_ids[row, attention[row].bool()].unsqueeze(0)
            logits = model(input_ids=ids).logits[0, -completion - 1 : -1].float()
            expected = logits.log_softmax(-1).gather(1, ids[0, -completion:].unsqueeze(1)).squeeze(1)
            torch.testing.assert_close(logps[row, :completion].float(), expected, atol=0.1, rtol=0.05)


def test_rows_of_one_length_take_the_dense_path_and_match_the_reference():
    torch.manual_seed(0)
    inputs = [
        torch.randn(1, h, 4 * 300, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (12, 2, 2)
    ]
    bounds = torch.arange(0, 4 * 300 + 1, 300, device="cuda")
    out = packed_attention(*inputs, bounds, 300, scaling=None)
    reference_inputs = [x.detach().float().requires_grad_() for x in inputs]
    reference = reference_packed_attention(*reference_inputs, bounds, scaling=None)
    torch.testing.assert_close(out.float(), reference, atol=2e-2, rtol=2e-2)
    grads = torch.autograd.grad(out.float().sum(), inputs)
    reference_grads = torch.autograd.grad(reference.sum(), reference_inputs)
    for value, expected in zip(grads, reference_grads, strict=True):
        torch.testing.assert_close(value.float(), expected, atol=5e-2, rtol=5e-2)


def test_float32_weights_under_bf16_autocast_reach_the_flash_kernel(tmp_path, monkeypatch):
    """Rotary embeddings upcast q and k to float32 when the weights are float32: the dispatcher casts them to
    autocast's precision, so the packed call runs the flash kernel rather than one SDPA call per row."""
    import trl_dapo.trainer.training.packed_attention as packed_module

    calls = []
    kernel = packed_module.flash_varlen_attention
    monkeypatch.setattr(packed_module, "flash_varlen_attention", lambda *a: calls.append(1) or kernel(*a))
    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "m"), dtype=torch.float32).cuda()
    enable_packed_attention(model)
    add_fused_lm_head(model)
    ids = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 0, 0]], device="cuda")
    packed = pack_rows(ids, (ids != 0).long(), 2)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        forward_packed(model, packed)
    assert len(calls) == model.config.num_hidden_layers

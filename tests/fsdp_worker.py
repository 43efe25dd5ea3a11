"""Run by `accelerate launch` on 2 CPU processes (gloo): the rollout engine's weights read from FSDP2 shards, and a
padding-free training pass through FSDP2 shards.

accelerate's FSDP2 path does not run on CPU processes (it needs a GPU launch), so the model is sharded here by the same
function accelerate's `prepare` calls (`fsdp2_prepare_model`, given an FSDP2 plugin), or by plain `fully_shard`
calls, and the engine is driven directly, as DAPOTrainer drives it: built from the model before it is sharded, synced
once sharded, synced again after an optimizer step. Each rank writes what it generated and the snapshot it holds,
beside the same from an unsharded copy of the model given the same weights. The padding-free pass: rank 0 packs three
uneven rows, rank 1 runs the empty pass a rank with no rows runs (its forward and backward are collectives of the
sharded model); each writes the gathered gradients beside an unsharded model's for rank 0's rows.
"""

import copy
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin
from accelerate.utils.fsdp_utils import fsdp2_prepare_model
from peft import LoraConfig, get_peft_model
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM
from trl.trainer.utils import add_fused_lm_head

from trl_dapo.rollout import PagedRolloutEngine, TokenSampling
from trl_dapo.rollout.sharded import FullyShardGather
from trl_dapo.trainer.training.packed_attention import enable_packed_attention, forward_packed
from trl_dapo.trainer.training.packing import pack_rows, unpack_scores

PROMPTS = [[5 + (7 * row + 3 * column) % 300 for column in range(3 + row)] for row in range(6)]  # uneven lengths
SETTINGS = {"greedy": TokenSampling(10, greedy=True), "sampled": TokenSampling(10, temperature=0.9, top_k=50)}


def engine(model, **options) -> PagedRolloutEngine:
    return PagedRolloutEngine(
        model, eos_token_ids=[2], pad_token_id=0, dtype=torch.float32, cuda_graph=False, device="cpu", **options
    )


def generations(rollout: PagedRolloutEngine) -> dict[str, tuple[list[list[int]], torch.Tensor]]:
    """Completions and logprobs for each of SETTINGS."""
    out = {}
    for name, settings in SETTINGS.items():
        torch.manual_seed(1)  # the same sampling noise on both sides
        generated = rollout.generate(PROMPTS, settings)
        out[name] = (generated.completions, generated.logprobs)
    return out


def weights(rollout: PagedRolloutEngine) -> dict[str, torch.Tensor]:
    """A copy of the snapshot (an unsharded fp32 one aliases the model's parameters, which the step moves)."""
    return {name: tensor.clone() for name, tensor in rollout.snapshot.tensors.items()}


def shard(model, layout: str, accelerator: Accelerator):
    if layout == "layers_and_root":  # the embedding, final norm and head stay in the root's group
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        return model
    return fsdp2_prepare_model(accelerator, model)


def optimizer_step(model, rank: int) -> None:
    """One SGD step on a rank-dependent batch: FSDP reduce-scatters the gradients, each rank updates its shard."""
    model.train()
    ids = torch.tensor([[3 + (11 * rank + 5 * t) % 200 for t in range(12)]] * 2)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=2.0)
    optimizer.step()
    optimizer.zero_grad()
    model.eval()


def run(layout: str, model_path: str, accelerator: Accelerator) -> dict:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_path)
    if layout == "accelerate_lora":
        config = LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"], init_lora_weights=False)
        model = get_peft_model(model, config)
    model.eval()
    reference = copy.deepcopy(model)
    rollout = engine(model, gather=FullyShardGather(model))  # before sharding, as in DAPOTrainer.__init__
    tensors_before = dict(rollout.snapshot.tensors)
    model = shard(model, layout.removesuffix("_lora"), accelerator)
    shards = {name: p.to_local().numel() / p.numel() for name, p in model.named_parameters() if isinstance(p, DTensor)}
    rollout.sync_weights(model)
    result = {
        "shard_fractions": shards,
        "parameters": sum(1 for _ in model.parameters()),
        "in_place": all(rollout.snapshot.tensors[name] is tensor for name, tensor in tensors_before.items()),
        "sharded": generations(rollout),
        "unsharded": generations(engine(reference)),
        "snapshot": weights(rollout),
        "unsharded_snapshot": weights(engine(reference)),
    }
    before_step = {name: p.full_tensor() for name, p in model.named_parameters()}
    optimizer_step(model, accelerator.process_index)
    with torch.no_grad():  # the updated weights gathered by DTensor, independently of the unsharding under test
        for name, parameter in model.named_parameters():
            reference.get_parameter(name).copy_(parameter.full_tensor())
    result["moved"] = max((p.full_tensor() - before_step[n]).abs().max().item() for n, p in model.named_parameters())
    rollout.sync_weights(model)
    result["stepped_snapshot"] = weights(rollout)
    result["stepped_unsharded_snapshot"] = weights(engine(reference))
    result["stepped_sharded"] = generations(rollout)
    result["stepped_unsharded"] = generations(engine(reference))
    result["built_from_shards"] = weights(engine(model, gather=FullyShardGather(model)))
    return result


def packed_loss(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, width: int) -> torch.Tensor:
    """The summed logprobs of the completion tokens, from one packed forward through TRL's fused head."""
    packed = pack_rows(input_ids, attention_mask, width)
    out = forward_packed(model, packed)
    return unpack_scores(out.log_probs, packed, width).sum()


def padding_free_pass(model_path: str, rank: int) -> dict:
    """Rank 0's rows (uneven, left-padded prompts) or rank 1's empty pass through FSDP2 shards; the gradients, summed
    over the ranks, against an unsharded model's for rank 0's rows."""
    model = AutoModelForCausalLM.from_pretrained(model_path)
    add_fused_lm_head(model)
    enable_packed_attention(model)
    reference = copy.deepcopy(model)
    rows = torch.tensor([[0, 0, 5, 6, 7, 8, 0, 0], [9, 10, 11, 12, 13, 14, 15, 16], [0, 17, 18, 19, 20, 0, 0, 0]])
    mask = (rows != 0).long()
    empty, empty_mask = torch.tensor([[0, 0]]), torch.ones(1, 2, dtype=torch.long)
    packed_loss(reference, rows, mask, 4).backward()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    loss = packed_loss(model, rows, mask, 4) if rank == 0 else packed_loss(model, empty, empty_mask, 1) * 0.0
    loss.backward()  # FSDP averages over the 2 ranks
    return {
        "sharded": {n: 2 * p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None},
        "unsharded": {n: p.grad for n, p in reference.named_parameters() if p.grad is not None},
    }


def main(model_path: str, output: str) -> None:
    accelerator = Accelerator(cpu=True)
    # accelerate sets the FSDP plugin only on a GPU launch; its sharding function reads nothing else from the state
    accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap"
    )
    layouts = ["accelerate", "layers_and_root", "accelerate_lora"]
    results = {layout: run(layout, model_path, accelerator) for layout in layouts}
    results["padding_free"] = padding_free_pass(model_path, accelerator.process_index)
    torch.save(results, f"{output}.rank{accelerator.process_index}.pt")
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

"""Run by ``test_fsdp.py`` in a process of its own: a patched model sharded with FSDP2
(``fully_shard``) over two CPU ranks (gloo), against the same model unpatched and sharded alike, and
the patched model under DistributedDataParallel.
Prints one JSON line of findings from rank 0; the test asserts on them."""

from __future__ import annotations

import copy
import json
import os
import sys
import tempfile
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from dropin_models import MODELS  # noqa: E402

LORA_TARGETS = {"llama": ["q_proj", "k_proj", "v_proj", "o_proj"], "gpt2": ["c_attn"],
                "gpt_neox": ["query_key_value", "dense"], "olmo2": ["q_proj", "k_proj", "v_proj", "o_proj"]}


def build(family: str) -> tuple[torch.nn.Module, object]:
    """The family's tiny model in bf16, and its drop-in as FSDP2 takes it (GPT-2's weights row-major:
    FSDP2 shards contiguous parameters only)."""
    patch = MODELS[family].patch
    return MODELS[family].build().bfloat16(), partial(patch, column_major_weights=False) if family == "gpt2" else patch


def shard(model: torch.nn.Module, **policy) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # a peft model's
    base = getattr(inner, inner.base_model_prefix)
    for layer in getattr(base, "layers", None) or getattr(base, "h"):
        fully_shard(layer, **policy)
    return fully_shard(model, **policy)


def train(model: torch.nn.Module, rank: int) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    vocab = getattr(model, "module", model).config.vocab_size  # under DDP the model is .module
    ids = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(rank))
    losses = []
    for _ in range(3):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def gathered(state: dict) -> dict:
    """Full tensors: get_model_state_dict(full_state_dict=True) returns DTensors for a sharded
    model that has not run a forward yet (FSDP2 initialises lazily), patched or not."""
    from torch.distributed.tensor import DTensor

    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}


def worker(rank: int, world: int, port: int, family: str, folder: str) -> None:
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    full = StateDictOptions(full_state_dict=True)
    found: dict = {}
    hf, patch = build(family)
    plain = shard(copy.deepcopy(hf))
    patched = shard(patch(copy.deepcopy(hf)))
    found["losses"] = {"hf": train(plain, rank), "coda": train(patched, rank)}
    # DistributedDataParallel, the other way a training script spreads a model (GPT-2's weights
    # column-major as apply_to_gpt2 stores them by default).
    from torch.nn.parallel import DistributedDataParallel

    found["ddp_losses"] = {"coda": train(DistributedDataParallel(MODELS[family].patch(copy.deepcopy(hf))), rank)}
    # The whole checkpoint, gathered (what a run saves for export): HF's keys and layout.
    ckpt = get_model_state_dict(patched, options=full)
    found["keys_as_hfs"] = sorted(ckpt) == sorted(get_model_state_dict(plain, options=full))
    found["all_full"] = all(type(v) is torch.Tensor for v in ckpt.values())
    unsharded = copy.deepcopy(hf)
    unsharded.load_state_dict(ckpt)  # into an unpatched model: interchangeable
    found["loads_unpatched"] = all(torch.equal(unsharded.state_dict()[k], ckpt[k]) for k in ckpt)
    fresh = shard(patch(copy.deepcopy(hf)))
    set_model_state_dict(fresh, dict(ckpt), options=full)  # it distributes the dict's values in place
    back = gathered(get_model_state_dict(fresh, options=full))
    found["full_roundtrip"] = all(torch.equal(back[k], ckpt[k]) for k in ckpt)
    # The sharded checkpoint (torch.distributed.checkpoint, as FSDP2 training saves and resumes).
    dcp.save(get_model_state_dict(patched), checkpoint_id=folder)
    resumed = shard(patch(copy.deepcopy(hf)))
    state = get_model_state_dict(resumed)
    dcp.load(state, checkpoint_id=folder)
    set_model_state_dict(resumed, state)
    back = gathered(get_model_state_dict(resumed, options=full))
    found["dcp_roundtrip"] = all(torch.equal(back[k], ckpt[k]) for k in ckpt)
    found["trains_after_resume"] = all(torch.isfinite(torch.tensor(train(resumed, rank))))
    # fp32 master weights: FSDP2 gathering them in bf16 (MixedPrecisionPolicy, no autocast), against
    # HF sharded the same way, and gathering them in fp32 under bf16 autocast.
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    found["fp32_policy_losses"] = {"hf": train(shard(copy.deepcopy(hf).float(), **policy), rank),
                                   "coda": train(shard(patch(copy.deepcopy(hf).float()), **policy), rank)}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        found["fp32_autocast_losses"] = {"coda": train(shard(patch(copy.deepcopy(hf).float())), rank)}
    # LoRA fine-tuning, sharded: the frozen base in the kernels, the adapters beside them.
    import peft

    def with_lora(model: torch.nn.Module) -> torch.nn.Module:
        torch.manual_seed(3)  # the same random adapters for both
        return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS[family],
                                                          init_lora_weights=False))

    found["lora_losses"] = {"hf": train(shard(with_lora(copy.deepcopy(hf))), rank),
                            "coda": train(shard(patch(with_lora(copy.deepcopy(hf)))), rank)}
    if rank == 0:
        print(json.dumps({"family": family, **found}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    family, port = sys.argv[1], int(sys.argv[2])
    with tempfile.TemporaryDirectory() as folder:
        torch.multiprocessing.spawn(worker, args=(2, port, family, folder), nprocs=2)

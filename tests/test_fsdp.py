"""The drop-ins under FSDP2, as a training team shards a model: ``fully_shard`` on every decoder
layer and the root, two CPU ranks over gloo (``fsdp_worker.py``, in a process of its own), the
patched model against the same model unpatched and sharded alike.  It trains the same losses, its
gathered checkpoint has HF's keys and loads into an unpatched model, and both a full checkpoint
(``set_model_state_dict``) and a sharded one (``torch.distributed.checkpoint``) load back into a
fresh patched model exactly.  fp32 master weights train alike, gathered in bf16 by FSDP2's
MixedPrecisionPolicy or in fp32 under bf16 autocast, DistributedDataParallel trains it alike, and
so does a LoRA fine-tune of it (peft's adapters sharded with their layers).
LLaMA's fused projections rename their parts' keys, which ``torch.distributed.checkpoint`` walks
to modules (``FusedPart``) and loads into sharded parameters (``fused_weights.placed_like``)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")  # the worker fine-tunes a LoRA model too
if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not built in", allow_module_level=True)

WORKER = Path(__file__).with_name("fsdp_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox", "olmo2"])
def test_a_patched_model_trains_and_checkpoints_under_fsdp2_and_ddp(family):
    run = subprocess.run([sys.executable, str(WORKER), family, str(free_port())], capture_output=True, text=True,
                         timeout=600)
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert run.returncode == 0 and lines, run.stderr[-4000:]
    found = json.loads(lines[-1])
    hf = found["losses"]["hf"]
    for run in (found["losses"]["coda"], found["ddp_losses"]["coda"], *found["fp32_policy_losses"].values(),
                found["fp32_autocast_losses"]["coda"]):
        assert run[-1] < run[0] - 1.0  # it trains
        if run is found["fp32_autocast_losses"]["coda"] and family == "olmo2":
            # apply_to_model leaves OLMo-2's layers HF's, and HF's own layers with fp32 parameters
            # under CPU autocast and FSDP2 train apart from the bf16 model (unpatched LLaMA: 5.63
            # against 4.68 at the third step); the drop-ins of whole layers run each layer as its
            # bf16 copy, which is what the bar below holds.
            continue
        assert max(abs(a - b) for a, b in zip(hf, run)) < 0.05, found  # as HF's bf16 model does, to bf16 noise
    lora = found["lora_losses"]  # a LoRA fine-tune, sharded
    assert lora["coda"][-1] < lora["coda"][0] and max(abs(a - b) for a, b in zip(lora["hf"], lora["coda"])) < 0.05
    for check in ("keys_as_hfs", "all_full", "loads_unpatched", "full_roundtrip", "dcp_roundtrip",
                  "trains_after_resume"):
        assert found[check] is True, (check, found)

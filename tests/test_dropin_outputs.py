"""What a patched model returns besides its loss and logits, for each drop-in: transformers
records the attention weights (``output_attentions=True``) and the hidden states with forward hooks
on its modules, and a patched layer computes attention without calling HF's attention module, so
the drop-ins hand the weights over themselves (``dropin.record_attention``)."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")
from dropin_models import MODELS  # noqa: E402

# On the GPU the patched layers run the cute lowering, so the weights they hand over come from
# the fused kernels' q and k, not the reference's.
DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Hopper)")])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", MODELS)
def test_attention_weights_and_hidden_states_come_back_as_hfs(family, device):
    build, patch = MODELS[family].build, MODELS[family].patch
    hf = build(attn_implementation="eager").bfloat16().to(device).eval()
    patched = patch(copy.deepcopy(hf)).eval()
    ids = torch.randint(0, hf.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        want = hf(ids, output_attentions=True, output_hidden_states=True)
        got = patched(ids, output_attentions=True, output_hidden_states=True)
    layers = hf.config.num_hidden_layers
    assert len(got.attentions) == len(want.attentions) == layers
    for a, b in zip(got.attentions, want.attentions):
        assert a.shape == b.shape and (a.float() - b.float()).abs().max() < 0.05  # probabilities, bf16 inputs
    assert len(got.hidden_states) == len(want.hidden_states) == layers + 1
    with torch.no_grad():  # and nothing is recorded unless asked for, as HF
        assert patched(ids).attentions is None


@pytest.mark.parametrize("family", MODELS)
def test_sdpa_records_no_attention_weights_as_hf(family):
    """SDPA returns no weights; HF's hook then records nothing, and so does a patched layer."""
    build, patch = MODELS[family].build, MODELS[family].patch
    hf = build().bfloat16().eval()  # the tiny configs attend through SDPA
    patched = patch(copy.deepcopy(hf)).eval()
    ids = torch.randint(0, hf.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = hf(ids, output_attentions=True), patched(ids, output_attentions=True)
    assert got.attentions == want.attentions

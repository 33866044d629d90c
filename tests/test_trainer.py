"""A patched model (each drop-in) inside transformers' Trainer, the way most fine-tuning runs:
fp32 master weights with ``bf16=True`` (accelerate's autocast), on the CPU.  It trains the losses
the unpatched model trains, its checkpoints are HF's (``from_pretrained`` loads them into an
unpatched model), and a patched model resumes from one as the unpatched model resumes.  The
Trainer keeps only the dataset columns the forward names, so a patched forward shows the replaced
one's signature."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from dropin_models import MODELS  # noqa: E402
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments  # noqa: E402


class Tokens(torch.utils.data.Dataset):
    def __init__(self, vocab: int):
        self.ids = torch.randint(0, vocab, (24, 32), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def fit(model: torch.nn.Module, out: str, steps: int, resume: str | None = None) -> tuple[Trainer, list[float]]:
    args = TrainingArguments(out, use_cpu=True, bf16=True, max_steps=steps, per_device_train_batch_size=4,
                             learning_rate=3e-3, lr_scheduler_type="constant", logging_steps=1, save_steps=3,
                             report_to=[], seed=0, data_seed=0, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(model.config.vocab_size))
    trainer.train(resume_from_checkpoint=resume)
    return trainer, [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("family", MODELS)
def test_a_patched_model_fine_tunes_checkpoints_and_resumes_in_the_trainer(tmp_path, family):
    build, patch = MODELS[family].build, MODELS[family].patch
    base = build()  # fp32: the Trainer's bf16=True autocasts around it
    patched = patch(copy.deepcopy(base))
    assert {"input_ids", "labels", "attention_mask"} <= set(inspect.signature(patched.forward).parameters)
    _, want = fit(copy.deepcopy(base), str(tmp_path / "hf"), 3)
    trainer, got = fit(patched, str(tmp_path / "coda"), 3)
    assert len(got) == len(want) == 3 and max(abs(a - b) for a, b in zip(got, want)) < 0.03, (got, want)
    checkpoint = tmp_path / "coda" / "checkpoint-3"
    plain = AutoModelForCausalLM.from_pretrained(checkpoint)  # HF's keys and layout, no coda_agent needed
    for k, v in patched.state_dict().items():
        assert torch.equal(plain.state_dict()[k], v), k
    # Resumed from it (the HF-layout weights into a fresh patched model, the optimizer's state, the
    # data order), steps 4 and 5 are those of the unpatched model resumed alike.  (Not always those
    # of a run that never stopped: a resumed GPT-NeoX departs from its own continuous run, in HF too.)
    _, hf_resumed = fit(copy.deepcopy(base), str(tmp_path / "hf"), 5, resume=str(tmp_path / "hf" / "checkpoint-3"))
    trainer, resumed = fit(patch(copy.deepcopy(base)), str(tmp_path / "coda"), 5, resume=str(checkpoint))
    assert trainer.state.global_step == 5 and resumed[:3] == got
    assert max(abs(a - b) for a, b in zip(resumed[3:], hf_resumed[3:])) < 0.03, (resumed, hf_resumed)

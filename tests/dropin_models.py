"""The drop-ins and what their test files test them on, for the tests that run them all (outputs,
mixed precision, the Trainer, LoRA, FSDP2): family -> :class:`DropIn`.  ``olmo2`` is
``apply_to_model`` on OLMo-2, a model no drop-in of whole layers takes."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Callable

import test_gpt2_dropin
import test_gpt_neox_dropin
import test_llama
import test_model_dropin

import coda_agent


@dataclass(frozen=True)
class DropIn:
    tests: ModuleType  # the family's test file: its batch(), train_and_eval() and truth_of()
    build: Callable  # its tiny fp32 model (seed, **config overrides)
    patch: Callable  # the drop-in


MODELS = {"llama": DropIn(test_llama, test_llama.tiny_llama, coda_agent.apply_to_llama),
          "gpt2": DropIn(test_gpt2_dropin, test_gpt2_dropin.tiny_gpt2, coda_agent.apply_to_gpt2),
          "gpt_neox": DropIn(test_gpt_neox_dropin, test_gpt_neox_dropin.tiny_neox, coda_agent.apply_to_gpt_neox),
          "olmo2": DropIn(test_model_dropin, test_model_dropin.tiny_olmo2, coda_agent.apply_to_model)}

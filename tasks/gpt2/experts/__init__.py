"""Expert (human-written) programs of the GPT-2 suite: the proof that each task
is solvable with the catalogue, and few-shot examples for other tasks' prompts.
They are loaded as program source by the verifier, never imported as modules.

Each module docstring counts its GEMMs and its passes over activations beyond
them (T x H tensors read or written that the plain GEMMs of the task do not
touch): the task's floor, against which the H200 measures it."""

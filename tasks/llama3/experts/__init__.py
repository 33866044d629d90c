"""Expert (human-written) programs of the LLaMA-3 suite: the proof that each task
is solvable with the catalogue, and few-shot examples for other tasks' prompts.
They are loaded as program source by the verifier, never imported as modules."""

"""rewind.engine.model: the live model and what holds its tensors: stacks of blocks and their layout,
the optimizer, the KL reference, pretrained weights and the transformers mapping, tensors to checkpoint
groups; where it all computes (placement, ranks) and the named randomness every part draws on (rng)."""

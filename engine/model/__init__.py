"""rewind.engine.model: the live model and what holds its tensors: stacks of blocks and their layout,
the optimizer, the KL reference, checkpoints, growth, pretrained weights and the transformers mapping,
and where it all computes (placement)."""

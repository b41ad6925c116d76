"""rewind.engine.step: one optimizer update shared by every strategy (micro-batches, clipping, AdamW at
the schedule's LR), the pretraining and sft objectives, and the named randomness every part draws on."""

"""rewind.engine.step: one optimizer update shared by every strategy (micro-batches, clipping, AdamW at
the schedule's LR), the objectives and evaluation, the live objects a step computes with (`live`), and
the stage kinds' engine specs by tag (`kinds`; the pretrain and sft step is `mixed_step`)."""

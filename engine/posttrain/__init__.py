"""rewind.engine.posttrain: the post-training kinds' engine halves (dpo, grpo, distill: their steps,
losses and rollouts), the sampler and generation, reward functions, and post-training figures. Reached
only through rewind.engine.step.kinds, by name: a pretraining run imports none of it."""

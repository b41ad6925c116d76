"""rewind.engine.posttrain: the post-training strategies' steps, losses and rollouts (dpo, grpo),
sampling and generation, reward functions, and post-training figures. A pretraining run imports none
of it."""

"""rewind.engine.data: what a step reads: datasets by name (embedded tasks and the user's files), token
streams, tokenizers, the stateless cursors, and the rows post-training stages read."""

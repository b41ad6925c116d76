"""rewind.engine.run: entering a run and driving it. `entry.enter` is the one way in (start, resume,
fork, replay and the read-only opens), building the live objects through `parts`; the loop asks
`rewind.states` what is due, records the event through the journal and applies its effect (`effects`,
`growth`, `checkpointing`, `trunkcache`)."""

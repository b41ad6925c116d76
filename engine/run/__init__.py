"""rewind.engine.run: entering a run and driving it. The loop asks `rewind.states` what is due, records
the event through the journal and applies its effect; session, fork and replay enter a run through one
assembler of live objects; ranks and evaluation serve the loop."""

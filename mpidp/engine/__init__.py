"""What the engine thread runs: queue, negotiation, cache, fusion and data paths."""

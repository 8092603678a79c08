"""Data paths behind one interface: `execute(batch, entries)` runs a negotiated batch."""

"""How a problem is measured: its inputs and references, honest timing, and the records a run produces."""

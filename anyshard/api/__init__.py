"""The API layer: save, load and open, over the reshard engine."""

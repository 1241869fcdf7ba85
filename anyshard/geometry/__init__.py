"""Geometry: boxes, pieces and shards, the pure arithmetic under every plan."""

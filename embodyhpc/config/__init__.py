"""Recipe schema, loading and world-size resolution (pure data; no torch)."""

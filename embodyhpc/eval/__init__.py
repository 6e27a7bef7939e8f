"""Simulation evaluation: shard planning, rollouts, aggregation."""

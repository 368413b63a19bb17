"""Routed experts as the engine sees them: the record codec, the ExpertStore protocol, the cluster."""

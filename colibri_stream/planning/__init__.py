"""'Will it fit' before anything loads: budgets, model and KV sizes, placement, bandwidth probes."""

"""What is on disk: checkpoint files, wrapped configs, packed quant schemes, dtypes, fingerprints, the demo model."""

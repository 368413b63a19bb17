"""Developer tools: the tiny transformers-built oracle fixtures and the demo model's training recipe."""

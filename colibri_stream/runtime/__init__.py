"""Running a model: the loader, the one turn, batching, sampling, sessions and their pool."""

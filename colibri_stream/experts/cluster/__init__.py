"""Experts sharded over worker processes on torch.distributed gloo."""

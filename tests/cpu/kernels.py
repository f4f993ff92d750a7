"""The CPU backend's kernel table as the model's builder makes it (engine build: layers.Kernels.from_table)."""
from cpu.kernels import table
from layers import Kernels

CPU = Kernels.from_table("cpu", table())

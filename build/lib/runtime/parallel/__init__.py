"""How a model is laid out over the devices: DDP, FSDP2, HSDP, tensor parallel, materialization
from meta, activation checkpointing and compiled blocks."""

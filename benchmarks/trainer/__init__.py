"""DAPOTrainer measured: its optimizer step against TRL's GRPOTrainer (each kind optionally in a process of its own),
dynamic sampling's cost, padded against packed training attention, and what a checkpoint's checksums would cost. It
imports `core` alone."""

"""Training-backend plugins: one process (local) and data-parallel FSDP2 (fsdp2)."""

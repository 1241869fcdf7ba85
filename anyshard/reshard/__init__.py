"""The reshard engine: where a checkpoint's shards are stored, the read planner, the parallel
executor that fills target regions with verified bytes, and verify_checkpoint."""

"""What a run publishes: step metrics, recorders (TensorBoard, W&B, JSONL, CSV, logs), the
progress display, the profiler and traces."""

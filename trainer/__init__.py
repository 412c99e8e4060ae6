"""What runs on the GPUs: model, data, DeepSpeed engine, Ray actors, run controller."""

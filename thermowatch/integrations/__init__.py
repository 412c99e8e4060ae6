"""Adapters for trainers that own the loop: `thermowatch.integrations.hf` (Hugging Face
`Trainer`) and `thermowatch.integrations.lightning` (Lightning). Each is imported by name only:
`import thermowatch` never pulls in transformers or lightning (docs/any-trainer.md)."""

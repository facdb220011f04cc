"""streamtune: streaming LoRA fine-tuning on Apache Flink."""

__version__ = "0.1.0"

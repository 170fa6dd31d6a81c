"""Model building blocks written for tensor parallelism: each parameter holds this rank's
shard and a `weight_loader(param, loaded_weight, shard_id=None)` that takes the full
Hugging Face tensor and copies that shard."""

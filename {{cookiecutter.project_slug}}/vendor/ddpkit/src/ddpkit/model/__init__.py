"""What a model's own code calls: BatchNorm synced on any device (batchnorm.py), per-layer compilation
(compiling.py) and sharding (sharding.py), the learning-rate schedule (schedules.py), the float32 matmul
precision (matmul.py) and a loss's mean over ranks (metrics.py)."""

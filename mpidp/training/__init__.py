"""The training wing: DistributedOptimizer and its buckets, hooks and passes; SyncBatchNorm."""

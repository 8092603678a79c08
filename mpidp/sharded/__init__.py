"""The sharded wing: ShardedOptimizer (ZeRO 1/2), its layout, buffers, state, join and scaler."""

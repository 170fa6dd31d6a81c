"""The local Redis Cluster of the tests lives in benchmarks/bench/redis_cluster.py, where
`headrace bench soak --hosts` starts one too."""

from benchmarks.bench.redis_cluster import LocalCluster, sync_client

__all__ = ["LocalCluster", "sync_client"]

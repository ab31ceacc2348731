"""redis-py's Redis Cluster clients, with the two pipeline commands lockstep needs that
redis-py refuses in a cluster pipeline: PUBLISH (no key, so no slot: sent through the
client, which picks a node, once the pipeline ran) and, in the synchronous client, EVAL
(routed by its first key like any command; the engines' lease renewal in a pipeline).
shared/bus.py's ``connect``/``connect_sync`` build these for ``redis+cluster://`` URLs."""

from __future__ import annotations

import asyncio
from typing import Any

import redis.cluster as sync_cluster
from redis.asyncio import cluster as async_cluster


class AsyncCluster(async_cluster.RedisCluster):
    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> "AsyncPipeline":
        return AsyncPipeline(self, transaction)


class AsyncPipeline(async_cluster.ClusterPipeline):
    def __init__(self, client: AsyncCluster, transaction: Any = None) -> None:
        super().__init__(client, transaction)
        self._order: list[tuple[Any, ...] | None] = []   # None: a command; else a publish

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        self._order.append(None)
        return super().execute_command(*args, **kwargs)

    def publish(self, channel: Any, message: Any, **kwargs: Any) -> "AsyncPipeline":
        self._order.append((channel, message))
        return self

    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> list[Any]:
        order, self._order = self._order, []
        results = list(await super().execute(raise_on_error, allow_redirections)) if None in order else []
        pubs = [p for p in order if p is not None]
        sent = await asyncio.gather(*(self.cluster_client.publish(*p) for p in pubs)) if pubs else []
        if len(results) != order.count(None):   # a multi-key command split by slot: publishes last
            return results + list(sent)
        merged, it_r, it_p = [], iter(results), iter(sent)
        for p in order:
            merged.append(next(it_r) if p is None else next(it_p))
        return merged


class SyncCluster(sync_cluster.RedisCluster):
    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> Any:
        pipe = super().pipeline(transaction, shard_hint)
        pipe.__class__ = SyncPipeline
        return pipe


class SyncPipeline(sync_cluster.ClusterPipeline):
    def eval(self, script: str, numkeys: int, *keys_and_args: Any) -> Any:
        return self.execute_command("EVAL", script, numkeys, *keys_and_args)

    def _get_command_keys(self, *args: Any) -> Any:
        # The pipeline asks its default node for EVAL's keys (COMMAND GETKEYS); with that
        # node SIGKILLed it failed every beat, never refreshing the slot map, so a rank's
        # liveness stayed down for good after a primary died (its slot lapsed, a spare
        # took it, the stale rank never learned). The keys are right there in the args.
        if args and str(args[0]).upper() in ("EVAL", "EVALSHA"):
            return list(args[3:3 + int(args[2])])
        return super()._get_command_keys(*args)

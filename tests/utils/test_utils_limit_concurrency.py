"""limit_concurrency: no more than n calls inside at once, per key; works across event loops."""

import asyncio

import pytest

from artnb.utils import limit_concurrency


class Gauge:
    """Counts how many calls are inside at once, per key."""

    def __init__(self):
        self.inside: dict[str, int] = {}
        self.peak: dict[str, int] = {}

    async def visit(self, key: str) -> None:
        self.inside[key] = self.inside.get(key, 0) + 1
        self.peak[key] = max(self.peak.get(key, 0), self.inside[key])
        for _ in range(5):  # yield to the loop so other calls get in if the limit lets them
            await asyncio.sleep(0)
        self.inside[key] -= 1


async def test_bounds_concurrent_calls():
    gauge = Gauge()

    @limit_concurrency(3)
    async def call(i: int) -> int:
        await gauge.visit("all")
        return i * 2

    assert await asyncio.gather(*(call(i) for i in range(20))) == [i * 2 for i in range(20)]
    assert gauge.peak["all"] == 3


async def test_each_key_gets_its_own_slots():
    gauge = Gauge()

    @limit_concurrency(2, derive_key=lambda server, *args, **kwargs: server)
    async def call(server: str, i: int) -> None:
        await gauge.visit(server)
        await gauge.visit("any")

    await asyncio.gather(*(call(server, i) for server in ("a", "b") for i in range(10)))
    assert gauge.peak["a"] == 2 and gauge.peak["b"] == 2
    assert gauge.peak["any"] > 2  # the keys do not share one limit


def test_usable_from_a_second_event_loop():
    gauge = Gauge()

    @limit_concurrency(1)
    async def call() -> None:
        await gauge.visit("all")

    async def many():
        await asyncio.gather(*(call() for _ in range(4)))

    asyncio.run(many())
    asyncio.run(many())  # a semaphore left bound to the first loop would raise here
    assert gauge.peak["all"] == 1


async def test_misuse_is_explained():
    with pytest.raises(ValueError, match="int >= 1"):
        limit_concurrency(0)

    @limit_concurrency(2)
    def not_async() -> int:
        return 1

    with pytest.raises(TypeError, match="async def"):
        await not_async()

"""`map_in_order`: a function over a stream of items on a pool of processes, results in order.

    for item, result in map_in_order(render, batches, workers=4, initializer=setup, initargs=(t,)):
        ...   # results arrive in the order the items were read, whatever process made them

With `workers == 1` everything runs in this process (no pickling, easy to debug). Otherwise the
processes are spawned, not forked: the reading process may run pyarrow's threads, and a fork
copies their locks in whatever state they are. A bounded window of `2 × workers` items keeps
every process busy without reading the input ahead into memory (`Pool.imap` would queue every
item at once).
"""

from __future__ import annotations

import multiprocessing
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


def map_in_order(
    function: Callable[[Item], Result],
    items: Iterable[Item],
    *,
    workers: int,
    initializer: Callable[..., None] | None = None,
    initargs: tuple[Any, ...] = (),
) -> Iterator[tuple[Item, Result]]:
    """`(item, function(item))` for every item, in input order; `function` and `initializer`
    must be importable top-level functions when `workers > 1`."""
    if workers == 1:
        if initializer is not None:
            initializer(*initargs)
        for item in items:
            yield item, function(item)
        return
    context = multiprocessing.get_context("spawn")
    window: deque[tuple[Item, Future[Result]]] = deque()
    with ProcessPoolExecutor(
        workers, mp_context=context, initializer=initializer, initargs=initargs
    ) as pool:
        for item in items:
            window.append((item, pool.submit(function, item)))
            if len(window) >= 2 * workers:
                done_item, done = window.popleft()
                yield done_item, done.result()
        while window:
            done_item, done = window.popleft()
            yield done_item, done.result()

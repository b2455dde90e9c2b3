"""The return channel of an RL generation: the decode steps that arrive while the stream is busy go
out as one message.

JetStream's detokenize thread hands every decode step of a request to its return channel
(`add_result`, through the event loop). Sending each step as its own gRPC message costs event-loop
time per message (JSON, framing, a write), and on a busy host that loop falls behind the device;
`BatchingChannel.batches()` then yields every step that is already waiting, so the messages shrink in
number, not the tokens in them. Order is kept; nothing waits for more steps to arrive.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from copc_jax.rollout.jetstream_adapter import async_multifuture


class BatchingChannel(async_multifuture.AsyncMultifuture):
  """An AsyncMultifuture (JetStream's orchestrator calls `add_result` and `close`) whose consumer
  takes all waiting results at once with `batches()`. Build it inside the event loop."""

  def __init__(self) -> None:
    super().__init__()
    self._waiting: list[Any] = []
    self._end: BaseException | None = None
    self._ready = asyncio.Event()

  def add_result(self, result: Any) -> None:
    self._loop.call_soon_threadsafe(self._add, result)

  def set_exception(self, exception: Exception) -> None:
    """Ends the stream after the results already added; the first call wins (as in the base class)."""
    self._loop.call_soon_threadsafe(self._finish, exception)
    self._loop.call_soon_threadsafe(self._done.set)

  def _add(self, result: Any) -> None:
    self._waiting.append(result)
    self._ready.set()

  def _finish(self, exception: BaseException) -> None:
    if self._end is None:
      self._end = exception
      self._ready.set()

  async def batches(self) -> AsyncIterator[list[Any]]:
    """Lists of results in arrival order, each everything that was waiting; ends at `close()`,
    raises what `set_exception` was given (a cancellation, a server error) after the results."""
    while True:
      await self._ready.wait()
      self._ready.clear()
      if self._waiting:
        batch, self._waiting = self._waiting, []
        yield batch
      if self._end is not None and not self._waiting:
        if isinstance(self._end, StopAsyncIteration):
          return
        raise self._end

  def __anext__(self):
    raise TypeError("BatchingChannel is read with batches()")

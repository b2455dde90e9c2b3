"""BatchingChannel: decode steps that arrive while the consumer is busy are delivered together, in order."""

import asyncio
import threading

import pytest

from copc_jax.rollout.channel import BatchingChannel


def collect(feed):
  """Run `feed(channel)` in a thread (as JetStream's detokenize thread would), then read the channel."""
  async def main():
    channel = BatchingChannel()
    thread = threading.Thread(target=feed, args=(channel,))
    thread.start()
    await asyncio.to_thread(thread.join)            # the consumer was busy while everything arrived
    return [batch async for batch in channel.batches()]
  return asyncio.run(main())


def test_waiting_results_come_as_one_batch_in_order_and_close_ends_the_stream():
  def feed(channel):
    for step in range(5):
      channel.add_result(step)
    channel.close()
  assert collect(feed) == [[0, 1, 2, 3, 4]]


def test_an_error_is_raised_after_the_results_before_it_and_only_the_first_end_counts():
  def feed(channel):
    channel.add_result("a")
    channel.set_exception(RuntimeError("server failed"))
    channel.close()                                       # ignored: the stream already ended
    channel.add_result("late")

  async def main():
    channel = BatchingChannel()
    thread = threading.Thread(target=feed, args=(channel,))
    thread.start()
    await asyncio.to_thread(thread.join)
    batches = []
    with pytest.raises(RuntimeError, match="server failed"):
      async for batch in channel.batches():
        batches.append(batch)
    return batches
  assert asyncio.run(main())[0][0] == "a"


def test_a_consumer_that_keeps_up_gets_each_result_as_it_comes():
  async def main():
    channel = BatchingChannel()
    received = []

    async def consume():
      async for batch in channel.batches():
        received.append(batch)
    task = asyncio.create_task(consume())
    for step in range(3):
      channel.add_result(step)
      while len(received) <= step:                       # wait until the consumer took it
        await asyncio.sleep(0)
    channel.close()
    await task
    assert channel.done()
    return received
  assert asyncio.run(main()) == [[0], [1], [2]]


def test_the_channel_is_read_with_batches_only():
  async def main():
    with pytest.raises(TypeError, match="batches"):
      await BatchingChannel().__anext__()
  asyncio.run(main())

"""Make a child process exit when the process that started it dies.

A SIGKILLed trainer gets no chance to stop its children (inference servers,
the math-verify worker); each of them calls `exit_when_orphaned()` instead.
"""

import os
import threading
import time


def exit_when_orphaned(interval_s: float = 0.5) -> None:
  """Start a daemon thread that exits this process once its parent is gone."""
  parent = os.getppid()

  def watch():
    while os.getppid() == parent:
      time.sleep(interval_s)
    os._exit(0)

  threading.Thread(target=watch, daemon=True, name="parent-watchdog").start()

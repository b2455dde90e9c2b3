import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from copc_jax.envs import math_tool, sandbox


@pytest.mark.parametrize("response, answer", [
    ("so the result is \\boxed{42}.", "42"),
    ("\\boxed{\\frac{1}{2}} then <answer>0.5</answer>", "0.5"),
    ("<answer>7</answer> wait, actually \\boxed{8}", "8"),
    ("nested \\boxed{\\sqrt{\\frac{a}{b}}}", "\\sqrt{\\frac{a}{b}}"),
    ("\\boxed{3} and an unterminated \\boxed{4", "3"),
    ("<answer>unterminated", None),
    ("", None),
    ("<answer>  </answer>", None),
])
def test_extract_answer(response, answer):
  assert math_tool.extract_answer(response) == answer


@pytest.mark.parametrize("turn, code", [
    ("let me compute <code>print(2+2)</code>", "print(2+2)"),
    ("<code>a</code> text <code>\nprint(1)\n</code>\n", "print(1)"),
    ("<code>print(1)", None),          # unterminated: no tool call
    ("print(1)</code>", None),         # no opening tag
    ("no code here", None),
])
def test_extract_code(turn, code):
  assert math_tool.extract_code(turn) == code


@pytest.mark.parametrize("prediction, truth, correct", [
    ("\\frac{1}{2}", "0.5", True),
    ("0.5", "\\frac{1}{2}", True),
    ("2", "2.0", True),
    ("1,000", "1000", True),
    ("x=3", "3", True),
    ("\\sqrt{4}", "2", True),
    ("3", "4", False),
    ("", "4", False),
])
def test_answers_match_equivalent_forms(prediction, truth, correct):
  assert math_tool.math_reward(f"\\boxed{{{prediction}}}", truth).correct is correct


def test_reward_penalises_code_errors_and_handles_malformed_output():
  assert math_tool.math_reward("\\boxed{5}", "5", code_error_penalty=0.1, code_errors=2).reward == \
      pytest.approx(0.8)
  assert math_tool.math_reward("no answer at all", "5").reward == 0.0
  assert math_tool.math_reward("<answer>5", "5").reward == 0.0


def test_reward_is_bounded_in_time_from_a_worker_thread():
  results = []
  thread = threading.Thread(target=lambda: results.append(math_tool.math_reward("\\boxed{0.5}", "1/2")))
  thread.start()
  thread.join(timeout=60)
  assert results and results[0].correct


@pytest.mark.skipif(sandbox.unavailable_reason() is not None and os.geteuid() != 0,
                    reason="the sandbox needs bubblewrap (setup.sh installs it as root)")
def test_code_tool_runs_code_in_the_sandbox():
  tool = math_tool.CodeTool(timeout_s=2)
  assert tool("<code>print(123 * 456)</code>") == "\n<output>\n56088\n</output>\n"
  out = tool("<code>1/0</code>")
  assert "error: ZeroDivisionError" in out and tool.errors == 1
  assert "timeout" in tool("<code>while True: pass</code>") and tool.errors == 2
  assert "no code found" in tool("<code>print(1)")


def test_many_threads_share_the_worker():
  from concurrent.futures import ThreadPoolExecutor

  pairs = [(f"{i}/2", str(i / 2)) for i in range(1, 25)] + [("3", "4")]
  with ThreadPoolExecutor(12) as executor:
    results = list(executor.map(lambda p: math_tool.answers_match(*p), pairs))
  assert results == [True] * 24 + [False]


def test_worker_exits_when_its_parent_is_killed():
  # A SIGKILLed trainer must not leave its math-verify worker behind.
  script = ("import threading; from copc_jax.envs import math_tool\n"
            "t = threading.Thread(target=math_tool.answers_match, args=('1', '1')); t.start(); t.join()\n"
            "print(*math_tool._worker._processes, flush=True)\n"
            "threading.Event().wait()\n")
  parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
  try:
    worker_pid = int(parent.stdout.readline())
  finally:
    parent.send_signal(signal.SIGKILL)
    parent.wait()
  deadline = time.monotonic() + 10
  while time.monotonic() < deadline:
    try:
      os.kill(worker_pid, 0)
    except ProcessLookupError:
      return
    time.sleep(0.1)
  os.kill(worker_pid, signal.SIGKILL)
  pytest.fail("the math-verify worker outlived its killed parent")

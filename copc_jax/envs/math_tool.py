"""Tool-integrated math: prompt, parsing of code calls and answers, tool execution, reward.

Format (ReTool / ToRL style): the model writes Python inside <code>...</code>;
generation stops at </code>, the code runs in the sandbox and the result comes
back inside <output>...</output> (mask = 0 tokens); the final answer is the last
\\boxed{...} or <answer>...</answer>. The reward is 1 when `math-verify` finds the
answer equal to the ground truth (0 otherwise), minus an optional penalty per
code execution that failed.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import threading
from concurrent.futures import CancelledError, ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool

from copc_jax import parent_watchdog
from copc_jax.envs import sandbox, tags

CODE_OPEN, CODE_CLOSE = "<code>", "</code>"
OUTPUT_OPEN, OUTPUT_CLOSE = "<output>", "</output>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"

SYSTEM_PROMPT = (
    "Solve the problem. You may run Python by writing it between <code> and </code>; its output "
    "comes back between <output> and </output>. Put the final answer in \\boxed{} or between "
    "<answer> and </answer>.")


def format_prompt(question: str) -> str:
  return f"{SYSTEM_PROMPT}\nProblem: {question}\n"


def extract_code(turn_text: str) -> str | None:
  """The code of a tool call: the text after the last <code> of a turn that ends with </code>."""
  body = tags.tool_call_body(turn_text, CODE_OPEN, CODE_CLOSE)
  return None if body is None else body.strip("\n")


def _last_boxed(text: str) -> str | None:
  start = text.rfind("\\boxed{")
  while start >= 0:
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
      if text[j] == "{":
        depth += 1
      elif text[j] == "}":
        depth -= 1
        if depth == 0:
          return text[i + 1:j]
    start = text.rfind("\\boxed{", 0, start)   # unterminated: try an earlier one
  return None


def extract_answer(response: str) -> str | None:
  """The final answer: the last complete <answer>…</answer> or \\boxed{…}, whichever comes later."""
  tagged = tags.tagged_spans(response, ANSWER_OPEN, ANSWER_CLOSE)
  boxed = _last_boxed(response)
  candidates = list(tagged)
  if boxed is not None:
    candidates.append((response.rfind("\\boxed{" + boxed), boxed))
  if not candidates:
    return None
  answer = max(candidates, key=lambda c: c[0])[1].strip()
  return answer or None


def _verify(prediction: str, ground_truth: str, timeout_s: int | None) -> bool:
  from math_verify import parse, verify
  if timeout_s is None:   # the worker process is bounded from outside; math-verify warns about it otherwise
    logging.getLogger("math_verify").setLevel(logging.ERROR)
  gold = parse(f"${ground_truth}$" if "$" not in ground_truth else ground_truth,
               parsing_timeout=timeout_s)
  pred = parse(f"${prediction}$" if "$" not in prediction else prediction, parsing_timeout=timeout_s)
  if not gold or not pred:
    return prediction.strip() == ground_truth.strip()
  return bool(verify(gold, pred, timeout_seconds=timeout_s))


_worker: ProcessPoolExecutor | None = None
_worker_lock = threading.Lock()


def _submit(prediction: str, ground_truth: str):
  """Submit a check to the worker process, starting it (outside any time limit) if needed."""
  global _worker
  with _worker_lock:
    if _worker is None:
      # spawn, not fork: forking a process that runs JAX threads can deadlock the child.
      worker = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=parent_watchdog.exit_when_orphaned)
      worker.submit(_verify, "1", "1", None).result()    # imports math-verify before the clock runs
      _worker = worker
    return _worker, _worker.submit(_verify, prediction, ground_truth, None)


def _replace_worker(worker: ProcessPoolExecutor) -> None:
  global _worker
  with _worker_lock:
    if _worker is worker:
      for process in list(getattr(worker, "_processes", {}).values()):
        process.kill()
      worker.shutdown(wait=False, cancel_futures=True)
      _worker = None


def answers_match(prediction: str, ground_truth: str, timeout_s: int = 5) -> bool:
  """math-verify equivalence, bounded in time in any thread.

  math-verify's own timeouts use SIGALRM, which only works in the main thread;
  elsewhere the check runs in a worker process that is replaced if it hangs
  (checks cancelled by that replacement are submitted again).
  """
  if threading.current_thread() is threading.main_thread():
    return _verify(prediction, ground_truth, timeout_s)
  for _ in range(3):
    worker, future = _submit(prediction, ground_truth)
    try:
      return future.result(timeout=timeout_s)
    except FutureTimeout:
      _replace_worker(worker)
      return False
    except (CancelledError, BrokenProcessPool):
      _replace_worker(worker)     # another check hung and took the worker down: try again
  return False


@dataclasses.dataclass(frozen=True)
class MathReward:
  correct: bool
  reward: float
  answer: str | None
  code_errors: int


def math_reward(response: str, ground_truth: str, *, code_error_penalty: float = 0.0,
                code_errors: int = 0, timeout_s: int = 5) -> MathReward:
  """1 if the final answer equals the ground truth (math-verify), minus the code-error penalty."""
  answer = extract_answer(response)
  correct = answer is not None and answers_match(answer, str(ground_truth), timeout_s)
  return MathReward(correct=correct, reward=float(correct) - code_error_penalty * code_errors,
                    answer=answer, code_errors=code_errors)


FAILED_RUN_PREFIXES = tuple(f"{OUTPUT_OPEN}\n{status}:" for status in ("error", "timeout", "memory",
                                                                      "output_limit"))


def count_code_errors(response: str) -> int:
  """Tool outputs in a response that report a failed run (as `CodeTool` formats them)."""
  return sum(response.count(prefix) for prefix in FAILED_RUN_PREFIXES)


@dataclasses.dataclass
class CodeTool:
  """Runs the code of a turn in the sandbox and formats its output block."""

  timeout_s: float = 5.0
  memory_mb: int = 256
  max_output_chars: int = 512
  errors: int = 0

  def __call__(self, turn_text: str) -> str:
    code = extract_code(turn_text)
    if code is None:
      return f"\n{OUTPUT_OPEN}\nno code found between {CODE_OPEN} and {CODE_CLOSE}\n{OUTPUT_CLOSE}\n"
    result = sandbox.run_python(code, timeout_s=self.timeout_s, memory_mb=self.memory_mb,
                                max_output_bytes=4 * self.max_output_chars)
    if result.status != "ok":
      self.errors += 1
    text = result.stdout if result.status == "ok" else (
        f"{result.status}: {result.stderr.strip().splitlines()[-1] if result.stderr.strip() else ''}")
    text = text.strip()[: self.max_output_chars]
    return f"\n{OUTPUT_OPEN}\n{text}\n{OUTPUT_CLOSE}\n"

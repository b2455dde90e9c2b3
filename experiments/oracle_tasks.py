"""Success rates of oracle policies with and without the tool, on both synthetic tasks.

  python -m experiments.oracle_tasks

With the tool: the code runs in the real sandbox, the queries go to the real
BM25 retriever, and the oracle reads the answer off the tool's output. Without
it: the best tool-free guess (a 2-significant-digit product; the most common
city of the knowledge base). Rewards are the tasks' own reward functions.
"""

import collections
import re

from copc_jax.envs import math_tool, search, synthetic_tasks


def arithmetic_rates(problems):
  tool = math_tool.CodeTool(timeout_s=5)
  with_tool = without = 0.0
  for p in problems:
    a, b = p["operands"]
    output = tool(f"{math_tool.CODE_OPEN}print({a} * {b}){math_tool.CODE_CLOSE}")
    value = output.split(math_tool.OUTPUT_OPEN)[1].split(math_tool.OUTPUT_CLOSE)[0].strip()
    with_tool += math_tool.math_reward(f"\\boxed{{{value}}}", p["answer"]).reward
    estimate = float(f"{a * 1.0:.2g}") * float(f"{b * 1.0:.2g}")   # mental arithmetic
    without += math_tool.math_reward(f"\\boxed{{{int(estimate)}}}", p["answer"]).reward
  return with_tool / len(problems), without / len(problems)


def search_rates(kb, questions, retriever):
  most_common_city = collections.Counter(kb.birthplace.values()).most_common(1)[0][0]
  tool = search.SearchTool(retriever=retriever)

  def lookup(query, pattern):
    info = tool(f"{search.SEARCH_OPEN}{query}{search.SEARCH_CLOSE}")
    match = re.search(pattern, info)
    return match.group(1) if match else ""

  with_tool = without = 0.0
  for q in questions:
    person = q["entity"]
    if q["hops"] == 2:
      person = lookup(f"{q['entity']} founded", re.escape(q["entity"]) + r" was founded by ([^.]+)\.")
    city = lookup(f"{person} born", re.escape(person) + r" was born in ([^.]+)\.") if person else ""
    with_tool += search.search_reward(f"<answer>{city}</answer>", q["answer"])
    without += search.search_reward(f"<answer>{most_common_city}</answer>", q["answer"])
  return with_tool / len(questions), without / len(questions)


def main():
  _, arithmetic_eval = synthetic_tasks.arithmetic_splits(seed=0)
  kb, _, knowledge_eval = synthetic_tasks.knowledge_splits(seed=0)
  retriever = search.Retriever(kb.passages())
  rows = [("tool arithmetic", len(arithmetic_eval), *arithmetic_rates(arithmetic_eval)),
          ("knowledge search", len(knowledge_eval), *search_rates(kb, knowledge_eval, retriever))]
  print(f"{'task':<18}{'eval items':>11}{'oracle with tool':>18}{'without tool':>14}")
  for name, n, with_tool, without in rows:
    print(f"{name:<18}{n:>11}{with_tool:>18.3f}{without:>14.3f}")


if __name__ == "__main__":
  main()

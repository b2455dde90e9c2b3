"""Synthetic versions of both tasks, generated deterministically from a seed, small enough for CPU.

- Tool arithmetic: exact products of multi-digit numbers; a tiny model cannot
  multiply 4-digit numbers in its head but can write `print(a * b)`.
- Synthetic knowledge search: a knowledge base of made-up people, cities and
  organisations (no model can know them); 1-hop questions ("Where was X born?")
  and 2-hop questions ("Where was the founder of O born?") answerable only by
  searching its passages.

Each has train/eval splits with disjoint questions, supervised demonstrations
for a warm start (the tool used correctly), and the tiny character tokenizer of
`copc_jax.models.tiny`, which covers all of their text.
"""

from __future__ import annotations

import dataclasses
import random

from copc_jax.envs import math_tool, search

SYLLABLES = ["ka", "lo", "mi", "ren", "to", "vex", "quor", "zan", "bel", "dri", "os", "pum", "ta", "vin",
             "yel", "gar", "hes", "nim", "sul", "wex"]


# --- tool arithmetic --------------------------------------------------------------

def arithmetic_problems(seed: int, count: int, digits: tuple[int, int] = (3, 4)) -> list[dict]:
  """`count` distinct "What is a * b?" problems with a, b of `digits` digits."""
  rng = random.Random(seed)
  problems, seen = [], set()
  while len(problems) < count:
    a = rng.randint(10 ** (digits[0] - 1), 10 ** digits[0] - 1)
    b = rng.randint(10 ** (digits[1] - 1), 10 ** digits[1] - 1)
    if (a, b) in seen:
      continue
    seen.add((a, b))
    problems.append({"question": f"What is {a} * {b}?", "answer": str(a * b), "operands": (a, b)})
  return problems


def arithmetic_splits(seed: int = 0, train: int = 512, eval: int = 128) -> tuple[list[dict], list[dict]]:
  problems = arithmetic_problems(seed, train + eval)
  return problems[:train], problems[train:]


def arithmetic_demonstration(problem: dict) -> str:
  """The response of a policy that uses the tool correctly (prompt excluded)."""
  a, b = problem["operands"]
  return (f"{math_tool.CODE_OPEN}print({a} * {b}){math_tool.CODE_CLOSE}\n{math_tool.OUTPUT_OPEN}\n"
          f"{a * b}\n{math_tool.OUTPUT_CLOSE}\n{math_tool.ANSWER_OPEN}{a * b}{math_tool.ANSWER_CLOSE}")


# --- synthetic knowledge search -----------------------------------------------------

def _name(rng: random.Random, parts: int) -> str:
  return "".join(rng.choice(SYLLABLES) for _ in range(parts)).capitalize()


@dataclasses.dataclass(frozen=True)
class KnowledgeBase:
  birthplace: dict[str, str]     # person -> city
  founder: dict[str, str]        # organisation -> person
  cities: tuple[str, ...]

  def passages(self) -> list[dict]:
    texts = [f"{person} was born in {city}." for person, city in self.birthplace.items()]
    texts += [f"{org} was founded by {person}." for org, person in self.founder.items()]
    return [{"id": str(i), "contents": t} for i, t in enumerate(texts)]


def knowledge_base(seed: int = 0, people: int = 200, organisations: int = 100,
                   cities: int = 20) -> KnowledgeBase:
  rng = random.Random(seed)
  unique = lambda make, n: list(dict.fromkeys(make() for _ in range(n * 10)))[:n]
  city_names = unique(lambda: _name(rng, 2) + "port", cities)
  person_names = unique(lambda: f"{_name(rng, 2)} {_name(rng, 2)}", people)
  org_names = unique(lambda: f"{_name(rng, 2)} Labs", organisations)
  birthplace = {p: rng.choice(city_names) for p in person_names}
  founder = {o: rng.choice(person_names) for o in org_names}
  return KnowledgeBase(birthplace=birthplace, founder=founder, cities=tuple(city_names))


def knowledge_questions(kb: KnowledgeBase) -> list[dict]:
  questions = [{"question": f"Where was {p} born?", "answer": c, "hops": 1, "entity": p}
               for p, c in kb.birthplace.items()]
  questions += [{"question": f"Where was the founder of {o} born?", "answer": kb.birthplace[p], "hops": 2,
                 "entity": o} for o, p in kb.founder.items()]
  return questions


def knowledge_splits(seed: int = 0, eval_fraction: float = 0.2) -> tuple[KnowledgeBase, list[dict], list[dict]]:
  kb = knowledge_base(seed)
  questions = knowledge_questions(kb)
  random.Random(seed + 1).shuffle(questions)
  cut = int(len(questions) * (1 - eval_fraction))
  return kb, questions[:cut], questions[cut:]


def search_demonstration(question: dict, kb: KnowledgeBase, retriever: search.Retriever, topk: int = 3,
                         guess: str | None = None) -> str:
  """The response of a policy that searches correctly, with the retriever's real top-k results; with
  `guess`, a 2-hop answer stops after the first search and answers `guess` instead of chaining."""
  steps, entity = [], question["entity"]
  queries = [f"{entity} born"] if question["hops"] == 1 else [f"{entity} founded", None]
  if guess is not None and question["hops"] == 2:
    queries = queries[:1]
  for query in queries:
    if query is None:
      query = f"{kb.founder[entity]} born"
    results = retriever.search([query], topk)[0]
    steps.append(f"{search.SEARCH_OPEN}{query}{search.SEARCH_CLOSE}{search.format_information(results)}")
  answer = question["answer"] if guess is None or question["hops"] == 1 else guess
  return "".join(steps) + f"{search.ANSWER_OPEN}{answer}{search.ANSWER_CLOSE}"
